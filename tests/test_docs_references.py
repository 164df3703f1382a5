"""Every file the documentation names is in the repository.

A reader who follows a reference to a file that only existed on the authors' machines (a design
note, an environment survey) is stranded; so is one sent to a module that was renamed. This reads
the README and every page under docs/ and ansible/, takes each token that looks like a file name,
and checks it: a path with a directory must exist from the repository root, from the page's own
directory or under a package, a bare name must be the name of some tracked file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "ansible").rglob("*.md"),
        *(ROOT / "fuzz").glob("*.md"),
        *(ROOT / "bench").glob("*.md"),
    ]
)

# A token ending in a file extension the project uses, possibly with directories.
REFERENCE = re.compile(r"(?<![\w./~-])([\w.-]+(?:/[\w.-]+)*\.(?:md|py|toml|sh|j2|yml|c|h))\b")

# Names that stand for what a reader writes, and host names that end like a file name.
PLACEHOLDERS = {
    "tests/test_x.py",
    "proxy.toml",
    "appliance.toml",
    "api.cursor.sh",
    "api2.cursor.sh",
}


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def _missing(page: Path, tracked: list[str]) -> list[str]:
    names = {Path(path).name for path in tracked}
    paths = set(tracked)
    missing = []
    for match in REFERENCE.finditer(page.read_text(encoding="utf-8")):
        ref = match.group(1)
        if ref in PLACEHOLDERS or ref.startswith(("http", "www.")):
            continue
        if "/" in ref:
            relative = (page.parent / ref).resolve()
            inside = relative.is_relative_to(ROOT)
            as_page_relative = inside and str(relative.relative_to(ROOT)) in paths
            # A path given inside a package's table ("io/tunnel.py" under proxycore/) counts.
            in_a_package = any(path.endswith("/" + ref) for path in paths)
            if ref not in paths and not as_page_relative and not in_a_package:
                missing.append(ref)
        elif ref not in names:
            missing.append(ref)
    return missing


def test_every_page_names_only_files_of_the_repository() -> None:
    tracked = _tracked()
    assert PAGES, "no documentation found"
    problems = {}
    for page in PAGES:
        missing = _missing(page, tracked)
        if missing:
            problems[str(page.relative_to(ROOT))] = sorted(set(missing))
    assert not problems, problems


def test_the_check_sees_a_reference_to_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("See DESIGN.md and `docs/nowhere.md`; the code is in proxycore/worker.py.\n")
    assert _missing(page, _tracked()) == ["DESIGN.md", "docs/nowhere.md"]
