"""Replay the daemon-input fuzzer's seeds (which pin what it found) with every selector byte."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_daemon_inputs.py"


def _load_harness() -> ModuleType:
    # fuzz/ is not a package; load the harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location("fuzz_daemon_inputs", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_daemon_inputs", module)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


@pytest.mark.parametrize("seed", harness.SEEDS)
@pytest.mark.parametrize("selector", range(4))
def test_seed_under_every_target(seed: bytes, selector: int) -> None:
    harness.TestOneInput(bytes([selector]) + seed[1:])


def test_a_config_that_is_not_utf8_is_a_config_error() -> None:
    from appliance.daemon.config import parse_config
    from appliance.daemon.errors import ConfigInvalid

    with pytest.raises(ConfigInvalid, match="not UTF-8"):
        parse_config(b"\n\xc5\n", source="appliance.toml")
