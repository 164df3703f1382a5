"""Fuzz what applianced reads from the operator: its config file and the admin API's bodies.

Run:  python fuzz/fuzz_daemon_inputs.py -runs=200000 /tmp/corpus_daemon
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

Byte 0 of the input chooses the target, the rest is the document:
- 0: a TOML config (`parse_config`). Only `ConfigInvalid` escapes; a config that parses is a
  fixed point (rebuilt from its plain form, it checks to the same value), its bounds are
  ordered and finite, and its default crew settings lie inside them.
- 1: a `crew create` body, decoded as the API does (`api.decode`), then
  `CrewManager.validate` against a real state store holding one crew and the no-isolation
  provider's runtimes. Only the daemon's own errors (`DaemonError`) escape; a request that
  passes has a name of the documented form with the prefix, a known mode, normalized and
  de-duplicated hosts (each its own `normalize_host` fixed point), a runtime the provider has,
  and memory and CPUs inside the configured bounds.
- 2, 3: `crew allow` and `run` bodies: only `InvalidRequest` escapes; argv is a tuple of str.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import trio

from appliance.daemon import messages
from appliance.daemon.api import decode as _decode
from appliance.daemon.config import ApplianceConfig, parse_config
from appliance.daemon.config import check_config as check_appliance_config
from appliance.daemon.crews import _NAME, MODES, CrewManager
from appliance.daemon.errors import ConfigInvalid, DaemonError, InvalidRequest
from appliance.daemon.state import CrewPhase, CrewRow, StateStore
from appliance.runtime.subprocess_provider import SubprocessProvider
from netns.addressing import check_crew_id
from proxycore.protocol.policy import normalize_host

PREFIX = "fz-"
_STATE = tempfile.TemporaryDirectory(prefix="fuzz-daemon-")
_CONFIG = parse_config(f'[crews]\nname_prefix = "{PREFIX}"\n')
_STORE = StateStore(_STATE.name)
_STORE.insert(
    CrewRow(
        name=f"{PREFIX}taken",
        mode="restricted",
        allow=(),
        runtime="subprocess",
        memory_bytes=_CONFIG.crews.default_memory_bytes,
        cpus=_CONFIG.crews.default_cpus,
        phase=CrewPhase.READY,
        created=0.0,
        updated=0.0,
    )
)
_PROVIDER = SubprocessProvider(_STATE.name)
# validate() reads the config, the state store and the provider's runtimes; the network manager
# and the proxy take part only once a crew is created, which this harness never does.
_MANAGER = CrewManager(
    _CONFIG,
    _PROVIDER,
    None,  # type: ignore[arg-type]
    _STORE,
    None,  # type: ignore[arg-type]
    ("agent", "infra"),
)

SEEDS: tuple[bytes, ...] = (
    b"\x00",
    b'\x00[crews]\nname_prefix = "x-"\ndefault_cpus = 0.5\n',
    b"\x00[crews]\nmax_cpus = nan\n",
    b"\x00[crews]\nmin_memory_bytes = 10\nmax_memory_bytes = 5\n",
    b"\x00[daemon]\nproxy_port = 70000\n",
    b'\x00[net]\npool = "10.0.0.0/8"\n',
    b'\x01{"name": "fz-a", "allow": ["api.anthropic.com", "API.anthropic.com."]}',
    b'\x01{"name": "fz-taken"}',
    b'\x01{"name": "fz-b", "mode": "free", "runtime": "subprocess", "cpus": 0.5}',
    b'\x01{"name": "fz-c", "memory_bytes": 1e400}',
    b'\x01{"name": "fz-d", "allow": ["1.2.3", "[::1]", "a..b"]}',
    b'\x01{"name": "fz-\\u00e9"}',
    b'\x02{"host": "example.com"}',
    b'\x03{"argv": ["true"], "timeout": -1}',
    b'\x03{"argv": []}',
    # Found: a config that is not UTF-8 raised UnicodeDecodeError instead of ConfigInvalid.
    b"\xc0\n\xc5\n",
)


def check_config(text: bytes) -> None:
    try:
        config = parse_config(text)
    except ConfigInvalid:
        return
    rebuilt = msgspec.convert(msgspec.to_builtins(config), ApplianceConfig)
    again = check_appliance_config(rebuilt, source="<again>")
    assert again == config, (config, again)
    crews = config.crews
    for value in (crews.min_cpus, config.max_cpus, crews.default_cpus):
        assert math.isfinite(value), config
    assert crews.min_memory_bytes <= crews.default_memory_bytes <= crews.max_memory_bytes, crews
    assert crews.min_cpus <= crews.default_cpus <= config.max_cpus, crews


async def validate(request: messages.CreateCrew) -> CrewRow:
    return await _MANAGER.validate(request)


def check_create(body: bytes) -> None:
    try:
        request = _decode(body, messages.CreateCrew)
        row = trio.run(validate, request)
    except DaemonError:
        return
    crews = _CONFIG.crews
    assert _NAME.fullmatch(row.name) and row.name.startswith(PREFIX), row
    assert check_crew_id(row.name) == row.name
    assert row.name != f"{PREFIX}taken"
    assert row.mode in MODES, row
    assert len(set(row.allow)) == len(row.allow), row
    for host in row.allow:
        assert normalize_host(host) == host, row
    assert row.runtime in _PROVIDER.runtimes(), row
    assert crews.min_memory_bytes <= row.memory_bytes <= crews.max_memory_bytes, row
    assert crews.min_cpus <= row.cpus <= _CONFIG.max_cpus, row
    assert row.phase is CrewPhase.CREATING


def check_small_bodies(body: bytes, kind: type[msgspec.Struct]) -> None:
    try:
        decoded = _decode(body, kind)
    except InvalidRequest:
        return
    if isinstance(decoded, messages.RunCommand):
        assert isinstance(decoded.argv, tuple) and all(isinstance(a, str) for a in decoded.argv)
    elif isinstance(decoded, messages.AllowHost):
        assert isinstance(decoded.host, str)


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    target, document = data[0] % 4, data[1:]
    if target == 0:
        check_config(document)
    elif target == 1:
        check_create(document)
    elif target == 2:
        check_small_bodies(document, messages.AllowHost)
    else:
        check_small_bodies(document, messages.RunCommand)


def main() -> None:
    import atheris

    for seed in SEEDS:
        TestOneInput(seed)
    from seeded import instrument

    instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
