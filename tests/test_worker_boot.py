"""How a proxy worker boots: on the data plane alone, with everything loaded before its
privilege drop and every later import refused (proxycore/worker.py, proxycore/preload.py).

- a worker imports nothing of appliance/ or netns/, and its command line refuses bad usage;
- the import graph: every import inside a function of every module a worker has loaded is
  preloaded, or is listed below with the reason no worker reaches it (a new lazy import in our
  code or in a dependency fails here, on any machine, before it fails a request on one whose
  interpreter is out of the worker's reach);
- the guard: a late import is refused and named once on stderr, a codec as LookupError, while
  names that are absent anyway stay quiet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_worker_imports_nothing_of_the_control_plane() -> None:
    done = run_python(
        "import sys, json, proxycore.worker\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('appliance', 'netns'))))"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_the_worker_command_line(tmp_path: Path) -> None:
    def worker(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "proxycore.worker", *args],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = worker("--config", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "cannot read config" in missing.stderr, missing
    (tmp_path / "bad.json").write_text('{"listen": {"port": 0}}')
    bad = worker("--config", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "listen.port" in bad.stderr, bad
    for ids in ("0:0", "1002", "x:1"):
        refused = worker("--config", "x.toml", "--drop-to", ids)
        assert refused.returncode == 2 and "UID:GID" in refused.stderr, refused
    alone = worker("--config", "x.toml", "--drop-to", "1002:1002")
    assert alone.returncode == 2 and "need --control-fd" in alone.stderr, alone


# Imported inside a function by a module a worker has loaded, and not preloaded: why no worker
# gets there. A key covers the module and its submodules.
NOT_REACHED = {
    # Other platforms.
    "_winapi": "Windows",
    "_winreg": "Windows",
    "winreg": "Windows",
    "nt": "Windows",
    "encodings.mbcs": "Windows",
    "sys.getwindowsversion": "Windows",
    "java": "Jython (platform)",
    "vms_lib": "OpenVMS (platform)",
    "plistlib": "macOS (platform.mac_ver)",
    # Features a worker does not use.
    "OpenSSL": "trio._dtls: DTLS",
    "_md5": "hashlib's built-in fallback for an algorithm OpenSSL lacks: a worker hashes nothing",
    "_sha1": "hashlib's built-in fallback (as _md5)",
    "_sha256": "hashlib's built-in fallback (as _md5)",
    "_sha3": "hashlib's built-in fallback (as _md5)",
    "_tokenize": "tokenize's C tokenizer (generate_tokens); linecache only detects an encoding",
    "asyncio": "sniffio: only when asyncio is already imported; typing_extensions on old Pythons",
    "curio": "sniffio: only when curio is already imported",
    "hypothesis": "trio's hypothesis plugin: only when hypothesis is imported",
    "trio.testing": "trio's hypothesis plugin: only when hypothesis is imported",
    "importlib.metadata": "package metadata (attr.__version__, distributions): not read",
    "importlib.readers": "importlib.resources: a worker reads no package resource",
    "tarfile": "shutil's archive functions",
    "zipfile": "shutil's archive functions",
    "statistics": "random's self-test",
    "doctest": "pickle's self-test",
    "getopt": "the command-line entry points of base64 and quopri",
    "pydoc": "interactive help (site)",
    "readline": "the interactive prompt (site)",
    "rlcompleter": "the interactive prompt (site)",
    "sitecustomize": "the site module's start-up, done before the drop",
    "usercustomize": "the site module's start-up, done before the drop",
    "tomli": "msgspec.toml on Pythons without tomllib: the config is read before the drop",
    "tomli_w": "msgspec.toml.encode: a worker writes no TOML",
    "tomllib": "msgspec.toml: the config is read before the drop (applianced's is JSON)",
    "yaml": "msgspec.yaml: a worker reads no YAML",
    "dns._asyncio_backend": "dnspython's asyncio backend: the worker runs on trio",
    "email.generator": "email.message serializing: importlib.metadata (dnspython's feature "
    "checks, all made at import in proxycore/io/dns.py) only parses",
    "email.policy": "email.message's default policy for content: importlib.metadata only parses",
    "py_compile": "zipfile.PyZipFile.writepy: a worker writes no archive",
}

SCAN = r"""
import ast, json, sys
from pathlib import Path

import trio

import proxycore.worker  # noqa: F401 (what `python -m proxycore.worker` has loaded)
from proxycore import preload
from proxycore.config import load_config
from proxycore.io.sinks import NullSink
from proxycore.runtime import ProxyRuntime

# What a worker has loaded when it drops its privileges and starts its trio loop.
runtime = ProxyRuntime(load_config(sys.argv[1]), NullSink())
preload.preload()
trio.run(trio.sleep, 0)


def lazy_imports(path, name, package):
    found = []

    class Visitor(ast.NodeVisitor):
        depth = 0

        def generic_visit(self, node):
            nested = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            self.depth += nested
            if self.depth and isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno) for alias in node.names)
            elif self.depth and isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = name if package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = parent + ("." + base if base else "")
                found.append((base, node.lineno))
                found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
            super().generic_visit(node)
            self.depth -= nested

    Visitor().visit(ast.parse(Path(path).read_bytes()))
    return found


missing = {}
for name, module in sorted(sys.modules.items()):
    path = getattr(module, "__file__", None) or ""
    if not path.endswith(".py"):
        continue
    for target, line in lazy_imports(path, name, path.endswith("__init__.py")):
        parent, _, attribute = target.rpartition(".")
        if target in sys.modules or hasattr(sys.modules.get(parent), attribute):
            continue  # loaded, or an attribute of a loaded module
        missing.setdefault(target, []).append(f"{name}:{line}")
print(json.dumps(missing))
"""


def test_every_lazy_import_is_preloaded_or_out_of_reach(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        '[[crew]]\nname = "a"\ngateway = "127.0.0.1"\n'
        '[providers.anthropic]\ncredential_env = "BOOT_KEY"\n'
    )
    done = subprocess.run(
        [sys.executable, "-c", SCAN, str(config)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "BOOT_KEY": "sk-ant-api03-boot-0123456789"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    missing: dict[str, list[str]] = json.loads(done.stdout)
    unexplained = {
        target: where
        for target, where in missing.items()
        if not any(target == key or target.startswith(key + ".") for key in NOT_REACHED)
    }
    assert not unexplained, (
        "imported inside a function and not preloaded: preload it in proxycore/preload.py, "
        f"or say in NOT_REACHED why no worker gets there: {unexplained}"
    )


GUARD = r"""
import codecs, sys, time
import proxycore.worker  # noqa: F401 (what `python -m proxycore.worker` has loaded)
from proxycore import preload

preloaded = preload.preload()
guard = preload.guard(preloaded)

def refused(name):
    try:
        __import__(name)
    except ModuleNotFoundError as exc:
        assert exc.name == name and "late import refused" in str(exc), exc
        return True
    return False

print("wave", refused("wave"), refused("wave"))  # named on stderr once
try:
    import xml.dom.minidom
except ImportError:
    print("xml refused")
# Preloaded: a codec, lazily imported modules, a non-ASCII host name.
print(codecs.lookup("unicode_escape").name, codecs.lookup("utf-16-be").name)
print("\u00e9".encode("unicode_escape"), "b\u00fccher.test".encode("idna"))
print(time.strptime("2024-05-01", "%Y-%m-%d").tm_mon)
# Absent anyway: refused without a word.
for name in ("no-such-codec", "mbcs"):
    try:
        codecs.lookup(name)
    except LookupError:
        print("no codec", name)
# A bug that repeats is named MAX_REPORTED times at most.
for index in range(preload.MAX_REPORTED + 10):
    refused(f"no_such_module_{index}")
print("counted", guard.refused["wave"], len(guard.refused))
"""


def test_the_guard_refuses_late_imports_and_names_them_once() -> None:
    done = run_python(GUARD)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == [
        "wave True True",
        "xml refused",
        "unicode-escape utf-16-be",
        "b'\\\\xe9' b'xn--bcher-kva.test'",
    ], lines
    assert lines[4:7] == ["5", "no codec no-such-codec", "no codec mbcs"], lines
    assert lines[7] == f"counted 2 {64}", lines
    refusals = [line for line in done.stderr.splitlines() if line.startswith("late import")]
    assert refusals[:2] == [
        "late import refused: wave; preload it in proxycore/preload.py",
        "late import refused: xml; preload it in proxycore/preload.py",
    ], refusals
    assert len(refusals) == 64  # MAX_REPORTED distinct modules, each once
