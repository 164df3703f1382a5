"""`appliancectl demo`: a short scripted tour of the proxy core on embedded defaults.

It starts a fake provider (real TLS, a throw-away CA) on loopback, starts the proxy as a real
process with a restricted crew, and shows, as an agent would see them:

1. an Anthropic Messages call with a dummy key, answered, while the upstream received the
   appliance's key and never the agent's;
2. a host that is not on the allowlist, refused with a readable JSON body;
3. SSRF refusals: an allowlisted name that resolves to a loopback address, and a numeric
   shorthand for 127.0.0.1;
4. the decision events the proxy wrote.

Everything stays on loopback: the names used resolve only through the proxy's own table.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from appliance.demo_upstream import start_fake

DEMO_KEY = "sk-ant-api03-DEMO-held-by-the-appliance-000000000000"
AGENT_KEY = "sk-agent-dummy"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _make_tls(workdir: Path) -> tuple[ssl.SSLContext, Path]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("api.anthropic.test")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    ca_path = workdir / "demo-ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    return context, ca_path


def _request(
    url: str,
    *,
    proxy: str | None = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, data=data, headers=headers or {})  # noqa: S310
    try:
        # Only http:// URLs the demo builds itself (loopback and the proxy).
        with opener.open(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def main(*, as_json: bool = False) -> int:
    results: list[dict[str, Any]] = []

    def show(step: str, ok: bool, detail: Any) -> None:
        results.append({"step": step, "ok": ok, "detail": detail})
        if not as_json:
            mark = "ok " if ok else "FAIL"
            print(f"[{mark}] {step}")
            print("       " + json.dumps(detail, indent=None)[:400])

    with tempfile.TemporaryDirectory(prefix="appliance-demo-") as tmp:
        workdir = Path(tmp)
        tls, ca_path = _make_tls(workdir)
        upstream = start_fake(tls_context=tls)
        key_file = workdir / "anthropic.key"
        key_file.write_text(DEMO_KEY)
        key_file.chmod(0o600)
        events = workdir / "events.jsonl"
        port = _free_port()
        config = workdir / "proxy.toml"
        config.write_text(f"""
[listen]
port = {port}

[[crew]]
name = "demo"
gateway = "127.0.0.1"
mode = "restricted"
allow = ["internal.test"]

[providers.anthropic]
base_url = "https://api.anthropic.test:{upstream.port}"
credential_file = "{key_file}"

[upstream]
ca_file = "{ca_path}"
# The fake provider lives on 127.0.0.1; the operator allows exactly that address.
ssrf_allow = ["127.0.0.1/32"]
resolve = {{ "api.anthropic.test" = "127.0.0.1", "internal.test" = "127.0.0.2" }}

[events]
path = "{events}"
flush_interval = 0.05
""")
        if not as_json:
            print(
                f"proxy config: {config}\nstarting the proxy on 127.0.0.1:{port} "
                f"(crew 'demo', restricted) ..."
            )
        process = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", "proxy", "--config", str(config)],
            stderr=subprocess.PIPE,
        )
        gateway = f"http://127.0.0.1:{port}"
        try:
            _wait(port, process)
            status, body = _request(
                f"{gateway}/anthropic/v1/messages",
                data=json.dumps(
                    {
                        "model": "claude-demo",
                        "max_tokens": 16,
                        "messages": [{"role": "user", "content": "hello"}],
                    }
                ).encode(),
                headers={"x-api-key": AGENT_KEY, "content-type": "application/json"},
            )
            seen = upstream.last()
            injected = seen.all("x-api-key") == [DEMO_KEY]
            show(
                "1. agent calls /anthropic/v1/messages with a dummy key",
                status == 200 and injected and AGENT_KEY not in json.dumps(seen.headers),
                {
                    "status": status,
                    "reply": body.get("content", [{}])[0].get("text"),
                    "upstream_saw_appliance_key": injected,
                    "upstream_saw_agent_key": AGENT_KEY in json.dumps(seen.headers),
                },
            )

            status, body = _request("http://exfil.example/", proxy=gateway)
            show(
                "2. agent asks for a host that is not allowlisted",
                status == 403 and body.get("rule") == "not_in_allowlist",
                body,
            )

            status, body = _request("http://internal.test/", proxy=gateway)
            show(
                "3a. allowlisted name resolving to a loopback address (SSRF)",
                status == 403 and str(body.get("rule", "")).startswith("ssrf_"),
                body,
            )

            status, body = _request("http://2130706433/", proxy=gateway)
            show(
                "3b. numeric shorthand for 127.0.0.1",
                status == 403 and body.get("rule") == "ip_shorthand",
                body,
            )

            time.sleep(0.3)
            lines = [json.loads(line) for line in events.read_text().splitlines()]
            kinds = [line["event"] for line in lines]
            show(
                "4. decision events written",
                {"request_allowed", "credential_injected", "request_denied"} <= set(kinds),
                kinds,
            )
            leaked = DEMO_KEY in events.read_text()
            show("5. the event log holds no credential", not leaked, {"key_in_log": leaked})
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
            upstream.close()
    ok = all(r["ok"] for r in results) and len(results) == 6
    if as_json:
        print(json.dumps({"ok": ok, "steps": results}))
    else:
        print("demo: all steps behaved as expected" if ok else "demo: SOME STEPS FAILED")
    return 0 if ok else 1


def _wait(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode() if process.stderr else ""
            raise SystemExit(f"demo: the proxy exited: {error}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("demo: the proxy did not start")


if __name__ == "__main__":
    sys.exit(main(as_json="--json" in sys.argv))
