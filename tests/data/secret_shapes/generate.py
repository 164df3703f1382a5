"""Writes positives.jsonl and negatives.jsonl: the corpus of tests/test_scrub_shapes.py.

Run from the repository root: `python tests/data/secret_shapes/generate.py`. Deterministic (one
seeded RNG per format), so the files only change when this script does.

Sources and licenses:
- gitleaks (https://github.com/gitleaks/gitleaks, MIT, (c) Zachary Rice): the token formats of
  `config/gitleaks.toml` and `cmd/generate/config/rules/*.go` (prefix, alphabet, length), the
  bare-token true-positive examples written out literally in those rules, and their literal
  false-positive (must-not-detect) examples (`gitleaks_fps.txt`, extracted verbatim).
- trufflehog (https://github.com/trufflesecurity/trufflehog, AGPL-3.0): facts only (a prefix and
  its length and alphabet for formats gitleaks lacks); no text of it is copied.

The formats below are written from those rule sets' regexes, not from our shapes
(native/scrub_patterns.py), so the test measures the shapes against the published formats.
GitHub and npm tokens carry their real CRC-32 tail (a random body would not be a token).
"""

from __future__ import annotations

import json
import random
import string
import uuid
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
PER_FORMAT = 8

A = string.ascii_letters + string.digits  # alphanumeric
U = string.ascii_uppercase + string.digits
L = string.ascii_lowercase + string.digits
H = "0123456789abcdef"
HU = "0123456789ABCDEF"
W = A + "_"  # \w
T = A + "_-"  # token characters
B64 = A + "+/"
BECH32 = "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L"
BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase

# (provider, rule, parts): a part is a literal string or (alphabet, length) or (alphabet, lo, hi)
FORMATS: list[tuple[str, str, list]] = [
    (
        "1password",
        "1password-secret-key",
        ["A3-", (U, 6), "-", (U, 11), "-", (U, 5), "-", (U, 5), "-", (U, 5)],
    ),
    ("1password", "1password-service-account-token", ["ops_eyJ", (B64, 250, 400)]),
    ("adafruit", "adafruit-io-key", ["aio_", (A, 28)]),
    ("adobe", "adobe-client-secret", ["p8e-", (A, 32)]),
    ("age", "age-secret-key", ["AGE-SECRET-KEY-1", (BECH32, 58)]),
    ("airtable", "airtable-personnal-access-token", ["pat", (A, 14), ".", (H, 64)]),
    ("alibaba", "alibaba-access-key-id", ["LTAI", (A, 20)]),
    ("anthropic", "anthropic-api-key", ["sk-ant-api03-", (T, 93), "AA"]),
    ("anthropic", "anthropic-admin-api-key", ["sk-ant-admin01-", (T, 93), "AA"]),
    ("artifactory", "artifactory-api-key", ["AKCp", (A, 69)]),
    ("artifactory", "artifactory-reference-token", ["cmVmd", (A, 59)]),
    ("atlassian", "atlassian-api-token", ["ATATT3", (T + "=", 186)]),
    ("aws", "aws-access-token", ["AKIA", ("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)]),
    ("aws", "aws-access-token", ["ASIA", ("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)]),
    ("aws", "aws-access-token", ["ABIA", ("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)]),
    ("aws", "aws-access-token", ["ACCA", ("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)]),
    ("aws", "aws-access-token", ["A3T", (U, 1), ("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)]),
    ("aws-bedrock", "aws-amazon-bedrock-api-key-long-lived", ["ABSK", (B64, 109, 269)]),
    (
        "aws-bedrock",
        "aws-amazon-bedrock-api-key-short-lived",
        ["bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t", (B64, 100, 300)],
    ),
    ("azure", "azure-ad-client-secret", [(A, 3), (string.digits, 1), "Q~", (A + "_~.-", 31, 34)]),
    ("azure", "azure-storage-account-key", ["AccountKey=", (B64, 86), "=="]),
    ("bitbucket", "bitbucket-app-password", ["ATBB", (A, 32)]),
    ("buildkite", "buildkite-token", ["bkua_", (H, 40)]),
    ("circleci", "circleci-pat", ["CCIPAT_", (A, 22), "_", (H, 40)]),
    ("clickhouse", "clickhouse-cloud-api-secret-key", ["4b1d", (A, 38)]),
    ("clojars", "clojars-api-token", ["CLOJARS_", (L, 60)]),
    ("cloudflare", "cloudflare-origin-ca-key", ["v1.0-", (H, 24), "-", (H, 146)]),
    ("contentful", "contentful-pat", ["CFPAT-", (T, 43)]),
    ("databricks", "databricks-api-token", ["dapi", (H, 32)]),
    ("deno", "deno-deploy-token", ["ddp_", (A, 36)]),
    ("digitalocean", "digitalocean-pat", ["dop_v1_", (H, 64)]),
    ("digitalocean", "digitalocean-access-token", ["doo_v1_", (H, 64)]),
    ("digitalocean", "digitalocean-refresh-token", ["dor_v1_", (H, 64)]),
    ("docker", "docker-hub-pat", ["dckr_pat_", (T, 27)]),
    ("doppler", "doppler-api-token", ["dp.pt.", (A, 43)]),
    ("doppler", "doppler-service-token", ["dp.st.", (A, 43)]),
    ("dropbox", "dropbox-short-lived-api-token", ["sl.", (A + "-_=", 135)]),
    ("duffel", "duffel-api-token", ["duffel_test_", (T + "=", 43)]),
    ("duffel", "duffel-api-token", ["duffel_live_", (T + "=", 43)]),
    ("dynatrace", "dynatrace-api-token", ["dt0c01.", (U, 24), ".", (A, 64)]),
    ("easypost", "easypost-api-token", ["EZAK", (A, 54)]),
    ("easypost", "easypost-test-api-token", ["EZTK", (A, 54)]),
    ("facebook", "facebook-page-access-token", ["EAAM", (A, 100, 200)]),
    ("facebook", "facebook-page-access-token", ["EAAC", (A, 100, 200)]),
    ("figma", "figma-pat", ["figd_", (T, 40)]),
    ("flutterwave", "flutterwave-secret-key", ["FLWSECK_TEST-", ("abcdefgh0123456789", 32), "-X"]),
    ("flutterwave", "flutterwave-public-key", ["FLWPUBK_TEST-", ("abcdefgh0123456789", 32), "-X"]),
    ("flutterwave", "flutterwave-encryption-key", ["FLWSECK_TEST-", ("abcdefgh0123456789", 12)]),
    ("fly", "flyio-access-token", ["fo1_", (T, 43)]),
    ("fly", "flyio-access-token", ["fm1r_", (B64, 100, 300)]),
    ("fly", "flyio-access-token", ["fm2_", (B64, 100, 300)]),
    ("frameio", "frameio-api-token", ["fio-u-", (T + "=", 64)]),
    ("gcp", "gcp-api-key", ["AIza", (T, 35)]),
    ("github", "github-pat", ["ghp_", "crc"]),
    ("github", "github-oauth", ["gho_", "crc"]),
    ("github", "github-app-token", ["ghu_", "crc"]),
    ("github", "github-app-token", ["ghs_", "crc"]),
    ("github", "github-refresh-token", ["ghr_", "crc"]),
    ("github", "github-fine-grained-pat", ["github_pat_", (A, 22), "_", (A, 59)]),
    ("gitlab", "gitlab-pat", ["glpat-", (T, 20)]),
    ("gitlab", "gitlab-pat-routable", ["glpat-", (T, 27, 60), ".", (L, 9)]),
    ("gitlab", "gitlab-cicd-job-token", ["glcbt-", (A, 1, 5), "_", (T, 20)]),
    ("gitlab", "gitlab-deploy-token", ["gldt-", (T, 20)]),
    ("gitlab", "gitlab-feature-flag-client-token", ["glffct-", (T, 20)]),
    ("gitlab", "gitlab-feed-token", ["glft-", (T, 20)]),
    ("gitlab", "gitlab-incoming-mail-token", ["glimt-", (T, 25)]),
    ("gitlab", "gitlab-kubernetes-agent-token", ["glagent-", (T, 50)]),
    ("gitlab", "gitlab-oauth-app-secret", ["gloas-", (T, 64)]),
    ("gitlab", "gitlab-ptt", ["glptt-", (H, 40)]),
    ("gitlab", "gitlab-rrt", ["GR1348941", (T, 20)]),
    ("gitlab", "gitlab-runner-authentication-token", ["glrt-", (T, 20)]),
    ("gitlab", "gitlab-scim-token", ["glsoat-", (T, 20)]),
    ("google", "google-oauth-client-secret", ["GOCSPX-", (T, 28)]),
    ("grafana", "grafana-api-key", ["eyJrIjoi", (A, 70, 120)]),
    ("grafana", "grafana-cloud-api-token", ["glc_", (B64, 32, 120)]),
    ("grafana", "grafana-service-account-token", ["glsa_", (A, 32), "_", (H, 8)]),
    ("groq", "groq-api-key", ["gsk_", (A, 52)]),
    ("hashicorp", "vault-service-token", ["hvs.", (T, 90, 120)]),
    ("hashicorp", "vault-batch-token", ["hvb.", (T, 138, 200)]),
    ("hashicorp", "hashicorp-tf-api-token", [(L, 14), ".atlasv1.", (T + "=", 60, 70)]),
    ("heroku", "heroku-api-key-v2", ["HRKU-AA", (T, 58)]),
    ("huggingface", "huggingface-access-token", ["hf_", (string.ascii_letters, 34)]),
    ("huggingface", "huggingface-organization-api-token", ["api_org_", (string.ascii_letters, 34)]),
    ("infracost", "infracost-api-token", ["ico-", (A, 32)]),
    ("intra42", "intra42-client-secret", ["s-s4t2ud-", (H, 64)]),
    ("intra42", "intra42-client-secret", ["s-s4t2af-", (H, 64)]),
    ("langsmith", "langsmith-api-key", ["lsv2_pt_", (H, 32), "_", (H, 10)]),
    ("linear", "linear-api-key", ["lin_api_", (A, 40)]),
    ("mapbox", "mapbox-secret-token", ["sk.eyJ", (A, 60), ".", (A, 22)]),
    ("neon", "neon-api-key", ["napi_", (L, 64)]),
    ("netlify", "netlify-pat", ["nfp_", (A, 36)]),
    ("new-relic", "new-relic-user-api-key", ["NRAK-", (U, 27)]),
    ("new-relic", "new-relic-insert-key", ["NRII-", (A + "-", 32)]),
    ("new-relic", "new-relic-browser-api-token", ["NRJS-", (H, 19)]),
    ("notion", "notion-api-token", ["ntn_", (string.digits, 11), (A, 35)]),
    ("npm", "npm-access-token", ["npm_", "crc"]),
    ("octopus-deploy", "octopus-deploy-api-key", ["API-", (U, 26)]),
    ("openai", "openai-api-key", ["sk-proj-", (T, 74), "T3BlbkFJ", (T, 74)]),
    ("openai", "openai-api-key", ["sk-svcacct-", (T, 58), "T3BlbkFJ", (T, 58)]),
    ("openai", "openai-api-key", ["sk-admin-", (T, 58), "T3BlbkFJ", (T, 58)]),
    ("openai", "openai-api-key", ["sk-", (A, 20), "T3BlbkFJ", (A, 20)]),
    ("openshift", "openshift-user-token", ["sha256~", (T, 43)]),
    ("perplexity", "perplexity-api-key", ["pplx-", (A, 48)]),
    ("pinecone", "pinecone-api-key", ["pcsk_", (A, 5), "_", (A, 60)]),
    ("planetscale", "planetscale-api-token", ["pscale_tkn_", (W + ".-", 43)]),
    ("planetscale", "planetscale-oauth-token", ["pscale_oauth_", (W + ".-", 43)]),
    ("planetscale", "planetscale-password", ["pscale_pw_", (W + ".-", 43)]),
    ("plaid", "plaid-api-token", ["access-production-", "uuid"]),
    ("plaid", "plaid-api-token", ["access-sandbox-", "uuid"]),
    ("postman", "postman-api-token", ["PMAK-", (H, 24), "-", (H, 34)]),
    ("prefect", "prefect-api-token", ["pnu_", (A, 36)]),
    ("pulumi", "pulumi-api-token", ["pul-", (H, 40)]),
    ("pypi", "pypi-upload-token", ["pypi-AgEIcHlwaS5vcmc", (T, 50, 200)]),
    ("razorpay", "razorpay-key", ["rzp_live_", (A, 14)]),
    ("readme", "readme-api-token", ["rdme_", (L, 70)]),
    ("render", "render-api-key", ["rnd_", (A, 32)]),
    ("replicate", "replicate-api-token", ["r8_", (A, 37)]),
    ("rubygems", "rubygems-api-token", ["rubygems_", (H, 48)]),
    ("scalingo", "scalingo-api-token", ["tk-us-", (T, 48)]),
    ("sendgrid", "sendgrid-api-token", ["SG.", (T, 22), ".", (T, 43)]),
    ("sendinblue", "sendinblue-api-token", ["xkeysib-", (H, 64), "-", (A, 16)]),
    ("sentry", "sentry-user-token", ["sntryu_", (H, 64)]),
    ("settlemint", "settlemint-personal-access-token", ["sm_pat_", (A, 16)]),
    ("settlemint", "settlemint-application-access-token", ["sm_aat_", (A, 16)]),
    ("settlemint", "settlemint-service-access-token", ["sm_sat_", (A, 16)]),
    ("shippo", "shippo-api-token", ["shippo_live_", (H, 40)]),
    ("shippo", "shippo-api-token", ["shippo_test_", (H, 40)]),
    ("shopify", "shopify-access-token", ["shpat_", (H, 32)]),
    ("shopify", "shopify-custom-access-token", ["shpca_", (H, 32)]),
    ("shopify", "shopify-private-app-access-token", ["shppa_", (H, 32)]),
    ("shopify", "shopify-shared-secret", ["shpss_", (H, 32)]),
    (
        "slack",
        "slack-bot-token",
        ["xoxb-", (string.digits, 12), "-", (string.digits, 13), "-", (A, 24)],
    ),
    (
        "slack",
        "slack-user-token",
        [
            "xoxp-",
            (string.digits, 11),
            "-",
            (string.digits, 11),
            "-",
            (string.digits, 12),
            "-",
            (H, 32),
        ],
    ),
    ("slack", "slack-app-token", ["xapp-1-A", (U, 10), "-", (string.digits, 13), "-", (H, 64)]),
    ("slack", "slack-config-refresh-token", ["xoxe-1-", (A, 146)]),
    ("slack", "slack-config-access-token", ["xoxe.xoxp-1-", (A, 163)]),
    ("slack", "slack-legacy-workspace-token", ["xoxa-2-", (A, 40)]),
    (
        "slack",
        "slack-legacy-token",
        [
            "xoxs-",
            (string.digits, 12),
            "-",
            (string.digits, 9),
            "-",
            (string.digits, 10),
            "-",
            (H, 10),
        ],
    ),
    (
        "slack",
        "slack-webhook-url",
        ["https://hooks.slack.com/services/T", (U, 8), "/B", (U, 8), "/", (A, 24)],
    ),
    ("sonarqube", "sonar-api-token", ["squ_", (H, 40)]),
    ("sourcegraph", "sourcegraph-access-token", ["sgp_", (H, 16), "_", (H, 40)]),
    ("square", "square-access-token", ["EAAA", (T, 60)]),
    ("square", "square-access-token", ["sq0atp-", (T, 22)]),
    ("square", "square-secret", ["sq0csp-", (T, 43)]),
    ("stripe", "stripe-access-token", ["sk_live_", (A, 24, 99)]),
    ("stripe", "stripe-access-token", ["sk_test_", (A, 24, 99)]),
    ("stripe", "stripe-access-token", ["rk_live_", (A, 24, 99)]),
    ("stripe", "stripe-access-token", ["sk_prod_", (A, 10, 99)]),
    ("stripe", "stripe-webhook-secret", ["whsec_", (A, 32)]),
    ("supabase", "supabase-pat", ["sbp_", (H, 40)]),
    ("tailscale", "tailscale-api-key", ["tskey-api-", (A, 17), "-", (A, 33)]),
    ("twilio", "twilio-api-key", ["SK", (H, 32)]),
    ("twitter", "twitter-bearer-token", ["A" * 22, (A + "%", 80, 100)]),
    ("typeform", "typeform-api-token", ["tfp_", (L + "-_.=", 59)]),
    ("xai", "xai-api-key", ["xai-", (A, 80)]),
    ("yandex", "yandex-api-key", ["AQVN", (T, 35, 38)]),
]


def _part(rng: random.Random, part: object) -> str:
    if isinstance(part, str):
        if part == "crc":
            body = "".join(rng.choice(A) for _ in range(30))
            value = zlib.crc32(body.encode())
            tail = ""
            for _ in range(6):
                value, digit = divmod(value, 62)
                tail = BASE62[digit] + tail
            return body + tail
        if part == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return part
    assert isinstance(part, tuple)
    alphabet, lo = part[0], part[1]
    hi = part[2] if len(part) == 3 else lo
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def positives() -> list[dict[str, str]]:
    out = []
    for provider, rule, parts in FORMATS:
        rng = random.Random(f"{rule}:{parts[0] if isinstance(parts[0], str) else ''}")
        for _ in range(PER_FORMAT):
            out.append(
                {
                    "provider": provider,
                    "rule": rule,
                    "source": "generated",
                    "token": "".join(_part(rng, p) for p in parts),
                }
            )
    for line in (HERE / "gitleaks_tps.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            rule, token = line.split("\t")
            out.append(
                {"provider": rule.split("-")[0], "rule": rule, "source": "gitleaks", "token": token}
            )
    return out


# Ordinary text a shape must leave alone: identifiers, hashes, ids, placeholders per prefix.
_PLACEHOLDER_PREFIXES = [
    "sk-ant-api03-",
    "sk-proj-",
    "sk-",
    "ghp_",
    "gho_",
    "github_pat_",
    "glpat-",
    "npm_",
    "hf_",
    "xoxb-",
    "xoxp-",
    "AKIA",
    "ASIA",
    "AIza",
    "sk_live_",
    "sk_test_",
    "SG.",
    "dop_v1_",
    "pypi-AgEIcHlwaS5vcmc",
    "shpat_",
    "lin_api_",
    "pplx-",
    "gsk_",
    "sntryu_",
    "rubygems_",
    "whsec_",
    "AccountKey=",
]
_PLACEHOLDER_BODIES = [
    "x" * 36,
    "X" * 40,
    "0" * 32,
    "EXAMPLE" * 5,
    "your_api_key_here_0000000000000",
    "YOUR_TOKEN_GOES_HERE_123456789",
    "<your-api-key>",
    "${API_KEY}",
    "{{ api_key }}",
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "1234567890abcdef1234567890abcdef",
    "REDACTED" * 5,
    "dummy-token-value-for-tests-only",
    "placeholder_placeholder_placeholder",
    "changeme-changeme-changeme",
    "fake_token_1a2b3c4d5e6f7g8h9i0j",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "SampleKeyForDocumentationPurposes12",
]


def negatives() -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    rng = random.Random("negatives")
    for prefix in _PLACEHOLDER_PREFIXES:
        for body in _PLACEHOLDER_BODIES:
            out.append({"kind": "placeholder", "text": prefix + body})
    for _ in range(100):
        out.append({"kind": "uuid", "text": str(uuid.UUID(int=rng.getrandbits(128), version=4))})
        out.append({"kind": "sha1", "text": f"{rng.getrandbits(160):040x}"})
        out.append({"kind": "sha256", "text": f"{rng.getrandbits(256):064x}"})
        out.append(
            {
                "kind": "base64",
                "text": "".join(rng.choice(B64) for _ in range(rng.randint(20, 120))),
            }
        )
    words = [
        w
        for w in (HERE / "identifiers.txt").read_text().splitlines()
        if w and not w.startswith("#")
    ]
    for w in words:
        out.append({"kind": "identifier", "text": w})
    for line in (HERE / "gitleaks_fps.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            out.append({"kind": "gitleaks-fp", "text": json.loads(line)})
    return out


HEADER = """# Generated by tests/data/secret_shapes/generate.py (deterministic); do not edit.
# Formats and literal examples from gitleaks (https://github.com/gitleaks/gitleaks, MIT
# License, Copyright (c) 2019 Zachary Rice); formats only (prefix, length, alphabet) from
# trufflehog (https://github.com/trufflesecurity/trufflehog, AGPL-3.0), no text copied.
# One JSON object per line.
"""


def main() -> None:
    for name, rows in (("positives.jsonl", positives()), ("negatives.jsonl", negatives())):
        with open(HERE / name, "w") as f:
            f.write(HEADER)
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(name, len(rows))


if __name__ == "__main__":
    main()
