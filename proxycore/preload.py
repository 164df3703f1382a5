"""Everything a proxy worker may import, loaded before it drops its privileges; then nothing more.

Theory of operation
-------------------
A worker drops to an unprivileged UID once it has read what it needs (proxycore/worker.py). From
then on the interpreter's own files may be out of its reach: a Python built under /root (pyenv,
mode 0700), a virtualenv or a checkout in a private directory. An import that happens only
then -- a codec looked up on first use, a module that a library imports inside a function --
fails there and works where the files are world-readable (Debian's python3): the same request
is a readable refusal on one install and a closed connection or a dead worker on another. It
happened: a CONNECT authority with a trailing dot needs the `unicode_escape` codec to quote it
in the 400, and compiling a granted credential into the scrubber needs `utf-16-be`.

So, before the drop, `preload()` imports:

- every module of the `encodings` package that imports on this platform: `str.encode(name)`,
  `bytes.decode(name)` and `codecs.lookup(name)` import the codec's module on first use;
- `STDLIB`: the standard modules that modules a worker has loaded import inside a function on a
  path a worker can take (each with the reason);
- `PACKAGES`: the same for the third-party packages the worker runs on.

How the lists were found: workers traced with PYTHONPROFILEIMPORTTIME through every route,
refusal and credential change imported only codecs after start-up (`unicode_escape`, and
`utf-16-be` when no key was configured at start); `STDLIB` and `PACKAGES` come from the import
graph (every import inside a function of every module a worker has loaded), and some of their
entries are loaded by other imports today, listed so that a change elsewhere cannot unload
them. tests/test_worker_boot.py re-reads that graph on every run, and
tests/test_worker_privdrop.py drives the workers from an interpreter their UID cannot read.

Right after the drop, `guard()` puts a finder first on `sys.meta_path` that refuses every
import that is not already done, with a ModuleNotFoundError naming the module, and says so once
per module on standard error ("late import refused: X; ..."). The refusal is the same on every
install, readable files or not, so a missed preload fails the tests on any machine instead of
only on the one whose interpreter is out of reach. A refused codec surfaces as LookupError
("unknown encoding") from `codecs.lookup`. Refused without a word: the names that did not
import before the drop either (`encodings.mbcs` on Linux), and names under `encodings.` that are
no module of it (the lookup of an unknown encoding name tries to import it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pkgutil
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

from proxycore.io.dns import PRELOAD_MODULES as DNS_MODULES

# Imported inside a function by a module the worker has loaded, on a path a worker can take.
STDLIB: tuple[str, ...] = (
    "_strptime",  # time.strptime, datetime.strptime (C code imports it on first call)
    "calendar",  # ssl.cert_time_to_seconds
    "copy",  # weakref.WeakValueDictionary.copy, collections.UserDict.copy
    "heapq",  # collections.Counter.most_common
    "linecache",  # warnings and traceback: source lines of a warning or a traceback
    "tokenize",  # linecache: the source encoding of a file it reads
    "traceback",  # warnings (a warning's traceback), logging.exception
    "tracemalloc",  # warnings: where the object of a ResourceWarning was allocated
    "unicodedata",  # encodings.idna, re (\N{...}), urllib.parse (netloc checks), traceback
    "stringprep",  # encodings.idna (nameprep)
    "_locale",  # locale.getpreferredencoding, for a text file opened after the drop
    "pwd",  # os.path.expanduser, pathlib.Path.owner
    "grp",  # pathlib.Path.group, shutil.chown
    "ast",  # traceback: the carets under the failing expression of a frame
)

# Imported inside a function by a third-party package the worker runs on.
PACKAGES: tuple[str, ...] = (
    "idna.uts46data",  # trio's getaddrinfo: idna.encode(host, uts46=True) of a non-ASCII name
    # dnspython (proxycore/io/dns.py): its trio backend and the record classes of an answer,
    # imported on first use.
    *DNS_MODULES,
)

# At most this many distinct refused modules are named on standard error (a bug would repeat).
MAX_REPORTED = 64


@dataclass(frozen=True)
class Preloaded:
    """What `preload` found: the modules of `encodings`, and the names that do not import here
    (codecs of another platform, such as `encodings.mbcs`)."""

    codecs: frozenset[str]
    absent: frozenset[str]

    def expected_absent(self, name: str) -> bool:
        """A refusal that is no missed preload: a name that did not import before the drop
        either, or a codec name that is no module of `encodings` (a lookup of an unknown
        encoding tries to import it)."""
        if name in self.absent:
            return True
        return bool(self.codecs) and name.startswith("encodings.") and name not in self.codecs


def preload() -> Preloaded:
    """Import every module a worker may need after its privileges are gone."""
    import encodings

    codecs = [f"encodings.{info.name}" for info in pkgutil.iter_modules(encodings.__path__)]
    absent = set()
    for name in (*codecs, *STDLIB, *PACKAGES):
        try:
            importlib.import_module(name)
        except ImportError:
            absent.add(name)
    return Preloaded(frozenset(codecs), frozenset(absent))


class LateImportGuard(importlib.abc.MetaPathFinder):
    """Finds nothing, and says so: every import after the drop is a missed preload."""

    def __init__(self, preloaded: Preloaded | None = None) -> None:
        self.preloaded = preloaded
        self.refused: dict[str, int] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if self.preloaded is None or not self.preloaded.expected_absent(fullname):
            count = self.refused.get(fullname)
            if count is not None:
                self.refused[fullname] = count + 1
            elif len(self.refused) < MAX_REPORTED:
                self.refused[fullname] = 1
                self._report(fullname)
        raise ModuleNotFoundError(
            f"late import refused: {fullname} (the worker has dropped its privileges)",
            name=fullname,
        )

    def _report(self, fullname: str) -> None:
        try:
            sys.stderr.write(
                f"late import refused: {fullname}; preload it in proxycore/preload.py\n"
            )
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed: the refusal itself still stands
            pass


def guard(preloaded: Preloaded | None = None) -> LateImportGuard:
    """Refuse every import from now on (installed first on sys.meta_path); name each refused
    module on standard error unless `preloaded` expects it to be absent."""
    finder = LateImportGuard(preloaded)
    sys.meta_path.insert(0, finder)
    return finder
