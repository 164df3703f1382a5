"""Configuration: unknown keys and bad values are errors that name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxycore.config import allowlist_sources, parse_config
from proxycore.errors import ConfigError
from proxycore.io.sinks import MemorySink
from proxycore.protocol.events import PolicyWarning
from proxycore.protocol.policy import DEFAULT_ALLOWED_HOSTS, NetworkMode
from proxycore.runtime import ProxyRuntime

BASE = """
[[crew]]
name = "a"
gateway = "127.0.0.1"
"""


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (BASE + "mdoe = 'free'\n", "mdoe"),
        ("[listen]\nport = 0\n", "$.listen.port"),
        ("[listen]\nport = 'x'\n", "$.listen.port"),
        ("[limits]\nmax_body_bytes = -1\n", "$.limits.max_body_bytes"),
        ("[[crew]]\nname = 'a b'\ngateway = '127.0.0.1'\n", "crew[0].name"),
        ("[[crew]]\nname = 'a'\ngateway = 'nope'\n", "crew[0].gateway"),
        (BASE + "allow = ['ok.test', 'bad host']\n", "crew[0].allow[1]"),
        (BASE + "[[crew]]\nname = 'a'\ngateway = '127.0.0.2'\n", "crew[1].name"),
        (
            "[providers.anthropic]\nbase_url = 'http://api.anthropic.com'\n",
            "providers.anthropic.base_url",
        ),
        ("[providers.openai]\nkey = 'sk-x'\n", "$.providers.openai"),
        ("[upstream]\nssrf_allow = ['0.0.0.0/0']\n", "upstream.ssrf_allow"),
        ("[upstream]\nssrf_allow = ['not-a-cidr']\n", "upstream.ssrf_allow"),
        ("[upstream]\nresolve = { 'x.test' = 'nope' }\n", "upstream.resolve.x.test"),
        ("[events]\nflush_interval = 0\n", "$.events.flush_interval"),
        ("[policy]\ndefault_allow = ['ok.test', 'bad host']\n", "policy.default_allow[1]"),
        ("[policy]\ndefault_allow = ['0x7f.1']\n", "policy.default_allow[0]"),
        ("[policy]\ndefault_allow = ['a.test.']\n", "policy.default_allow[0]"),
        ("[policy]\ndefault_allow = 'api.anthropic.com'\n", "$.policy.default_allow"),
        ("[policy]\ndefault_alow = []\n", "default_alow"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert named in str(caught.value)


def test_unknown_mode_is_restricted_and_reported() -> None:
    config = parse_config(BASE + "mode = 'fre'\n")
    sink = MemorySink()
    runtime = ProxyRuntime(config, sink)
    assert runtime.crews["127.0.0.1"].policy.mode is NetworkMode.RESTRICTED
    warnings = [e for e in sink.events if isinstance(e, PolicyWarning)]
    assert warnings and "fre" in warnings[0].message


def test_missing_mode_is_restricted() -> None:
    runtime = ProxyRuntime(parse_config(BASE), MemorySink())
    assert runtime.crews["127.0.0.1"].policy.mode is NetworkMode.RESTRICTED
    assert "api.anthropic.com" in runtime.crews["127.0.0.1"].policy.allowlist
    assert "anthropic.com" not in runtime.crews["127.0.0.1"].policy.allowlist


def test_default_allow_is_configuration() -> None:
    """`[policy] default_allow` decides what a restricted crew may reach besides its own allow;
    the provider hosts (the reverse routes' destinations) stay whatever it says."""
    shipped = ProxyRuntime(parse_config(BASE), MemorySink()).crews["127.0.0.1"].policy.allowlist
    assert set(DEFAULT_ALLOWED_HOSTS) <= set(shipped)
    none = ProxyRuntime(parse_config("[policy]\ndefault_allow = []\n" + BASE), MemorySink())
    assert list(none.crews["127.0.0.1"].policy.allowlist) == sorted(
        ["api.anthropic.com", "api.openai.com", "generativelanguage.googleapis.com"]
    )
    one = parse_config("[policy]\ndefault_allow = ['Registry.NPMJS.org:443']\n" + BASE)
    runtime = ProxyRuntime(one, MemorySink())
    assert "registry.npmjs.org" in runtime.crews["127.0.0.1"].policy.allowlist
    assert "chatgpt.com" not in runtime.crews["127.0.0.1"].policy.allowlist


def test_allowlist_sources_name_where_each_host_comes_from() -> None:
    config = parse_config(
        "[policy]\ndefault_allow = ['accounts.google.com', 'github.com']\n"
        "[providers.anthropic]\nbase_url = 'https://llm.example.test:8443/anthropic'\n"
    )
    assert allowlist_sources(config, ("github.com", "pypi.org")) == [
        ("github.com", ("crew", "default")),
        ("pypi.org", ("crew",)),
        ("accounts.google.com", ("default",)),
        ("llm.example.test", ("provider",)),
        ("api.openai.com", ("provider",)),
        ("generativelanguage.googleapis.com", ("provider",)),
    ]
    # The proxy's own allowlist for such a crew holds exactly these hosts.
    crew = parse_config(
        "[policy]\ndefault_allow = ['accounts.google.com', 'github.com']\n"
        "[providers.anthropic]\nbase_url = 'https://llm.example.test:8443/anthropic'\n"
        + BASE
        + "allow = ['github.com', 'pypi.org']\n"
    )
    held = ProxyRuntime(crew, MemorySink()).crews["127.0.0.1"].policy.allowlist
    assert sorted(held) == sorted(host for host, _ in allowlist_sources(config, crew.crew[0].allow))


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[proxy.policy]\ndefault_allow = ['fine.test', 'not a host']\n", "default_allow[1]"),
        ("[proxy.policy]\ndefault_allow = 5\n", "$.proxy.policy.default_allow"),
        ("[proxy.policy]\nallow = []\n", "$.proxy.policy"),
    ],
)
def test_applianced_policy_errors_name_the_key(text: str, named: str) -> None:
    from appliance.daemon.config import parse_config as parse_daemon_config
    from appliance.daemon.errors import ConfigInvalid

    with pytest.raises(ConfigInvalid) as caught:
        parse_daemon_config(text, source="appliance.toml")
    assert named in str(caught.value) and "appliance.toml" in str(caught.value)


def test_applianced_passes_its_policy_to_the_workers() -> None:
    from appliance.daemon.config import parse_config as parse_daemon_config

    config = parse_daemon_config("[proxy.policy]\ndefault_allow = ['github.com']\n")
    assert config.proxy_config().policy.default_allow == ("github.com",)
    assert parse_daemon_config("").proxy_config().policy.default_allow == DEFAULT_ALLOWED_HOSTS


def test_credential_never_in_error_or_repr(tmp_path, monkeypatch) -> None:
    secret = "sk-ant-api03-NEVER-PRINT-ME"
    monkeypatch.setenv("KEY_WITH_NEWLINE", secret + "\nx")
    config = parse_config(BASE + "[providers.anthropic]\ncredential_env = 'KEY_WITH_NEWLINE'\n")
    with pytest.raises(ConfigError) as caught:
        ProxyRuntime(config, MemorySink())
    assert secret not in str(caught.value)
    monkeypatch.setenv("GOOD_KEY", secret)
    runtime = ProxyRuntime(
        parse_config(BASE + "[providers.anthropic]\ncredential_env = 'GOOD_KEY'\n"), MemorySink()
    )
    route = runtime.routes.by_host["api.anthropic.com"]
    assert secret not in repr(route) and secret not in str(route.credential)


def test_cli_reports_config_error_with_exit_code_2(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[listen]\nprot = 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "proxy", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "prot" in result.stderr
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "proxy",
            "--config",
            str(tmp_path / "missing.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "cannot read config" in result.stderr
