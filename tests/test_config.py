"""Configuration: unknown keys and bad values are errors that name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxycore.config import parse_config
from proxycore.errors import ConfigError
from proxycore.io.sinks import MemorySink
from proxycore.protocol.events import PolicyWarning
from proxycore.protocol.policy import NetworkMode
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
