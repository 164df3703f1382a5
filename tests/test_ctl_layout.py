"""The shape of the control plane, checked: no import circle in appliance/, one routes table that
the typed client covers, the documentation's commands against the real argparse tree, the exit
code table of docs/cli.md against exits.py."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from appliance.ctl import exits
from appliance.ctl.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "appliance"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The appliance.* modules `path` imports, at any depth (function-level imports too: a
    circle through a lazy import is a circle), except under `if TYPE_CHECKING:`."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_no_import_circle_in_appliance() -> None:
    graph = import_graph()
    assert graph.get("appliance.ctl.main"), graph
    assert circles(graph) == []


def test_the_circle_finder_finds_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_run_fast_path_imports_only_dependency_free_modules() -> None:
    graph = import_graph()
    allowed = {
        "appliance.ctl.fast",
        "appliance.ctl.attach",
        "appliance.ctl.http",
        "appliance.ctl.session",
        "appliance.ctl.tinyjson",
        "appliance.ctl.exits",
        "appliance.daemon.framing",
        "appliance._version",  # `--version` answered without the full CLI
        "appliance.ctl.main",  # the fallback to the full CLI, imported only then
    }
    assert graph["appliance.ctl.fast"] <= allowed
    for module in allowed - {"appliance.ctl.fast", "appliance.ctl.main"}:
        assert graph[module] <= allowed, module
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert not re.search(r"^(import|from) (typing|socket|json|msgspec)\b", source, re.M), module


def test_no_module_of_the_cli_is_over_500_lines() -> None:
    for path in (PACKAGE / "ctl").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path
    for path in (PACKAGE / "cli.py", PACKAGE / "daemon" / "api.py"):
        assert len(path.read_text().splitlines()) <= 500, path


def test_dead_modules_are_gone() -> None:
    for gone in ("process_output.py", "ctl.py", "daemon/client.py"):
        assert not (PACKAGE / gone).exists(), gone


def test_the_two_default_admin_sockets_agree() -> None:
    from appliance.ctl.http import DEFAULT_ADMIN_SOCKET
    from appliance.daemon.config import DEFAULT_ADMIN_SOCKET as DAEMON_DEFAULT

    assert DEFAULT_ADMIN_SOCKET == DAEMON_DEFAULT


def test_every_route_has_a_client_method() -> None:
    """Each row of api.ROUTES is called by appliance/ctl/client.py (its method and path)."""
    from appliance.daemon.api import ROUTES

    client = (PACKAGE / "ctl" / "client.py").read_text() + (
        PACKAGE / "ctl" / "session.py"
    ).read_text()
    for method, pattern, _ in ROUTES:
        literal = re.sub(r"\{\w+\}", "{", pattern).split("{")[0]
        assert literal in client, (method, pattern)
    seen = {(method, pattern) for method, pattern, _ in ROUTES}
    assert len(seen) == len(ROUTES), "a route twice"


def test_routing_answers_404_and_405() -> None:
    from appliance.daemon.api import Handlers, _MethodNotAllowed, _NotFound, route

    handler, params = route("POST", "/v1/credentials/a%2Fb/grant")
    assert handler is Handlers.grant and params == {"name": "a/b"}
    assert route("GET", "/v1/crews/c1")[1] == {"name": "c1"}
    with pytest.raises(_MethodNotAllowed, match="only GET, DELETE"):
        route("PUT", "/v1/crews/c1")
    with pytest.raises(_NotFound):
        route("GET", "/v1/crews/c1/nothing")
    with pytest.raises(_NotFound):
        route("GET", "/v2/status")


# -- the documentation's commands --------------------------------------------------------------

DOCS = [ROOT / "README.md", ROOT / "ansible" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_INLINE = re.compile(r"`((?:appliancectl|applianced) [^`]+)`")
_FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line): every `appliancectl ...` in inline code, and every line of a code
    block that runs appliancectl (after `$ `, `sudo `, or a pipe)."""
    found: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text()
        for match in _INLINE.finditer(text):
            found.append((path.name, match.group(1)))
        for block in _FENCE.finditer(text):
            for line in block.group(1).splitlines():
                line = line.split(" #", 1)[0].strip()
                for part in line.split("|"):
                    words = part.strip().removeprefix("$ ").removeprefix("sudo ").strip()
                    if re.match(r"(appliancectl|applianced)( |$)", words):
                        found.append((path.name, words))
    return found


def _tree(parser: object) -> tuple[dict[str, object], dict[str, bool]]:
    """(subcommands, {option: takes a value})."""
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    commands: dict[str, object] = {}
    options: dict[str, bool] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
        for option in action.option_strings:
            options[option] = action.nargs != 0
    return commands, options


def check_command(line: str) -> str | None:
    """What is wrong with a documented command line, or None: each command word must be a
    subcommand where one is expected, each option one the command (or a parent) takes.
    Placeholders (NAME, CREW...) and values are not judged."""
    words = shlex.split(line.replace("[", " ").replace("]", " "), posix=True)
    program = words.pop(0)
    parser: object = build_parser()
    if program == "applianced":
        from appliance.daemon import main as daemon_main

        daemon_parser = getattr(daemon_main, "build_parser", None)
        if daemon_parser is None:
            return "applianced has no command line of its own: `appliancectl up` starts it"
        parser = daemon_parser()
    commands, known = _tree(parser)
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "--":
            break
        if word.startswith(("<", ">")) or word in ("...", "|"):
            break
        if word.startswith("-"):
            for option in word.split("|"):
                name, has_value = option.split("=", 1)[0], "=" in option
                if not name.startswith("-"):
                    continue
                if name not in known:
                    return f"unknown option {name}"
                skip = known[name] and not has_value and "|" not in word
            continue
        if commands:
            if word not in commands:
                if word.isupper() or not word.isalpha():
                    continue  # a placeholder where a command's argument goes
                return f"unknown command {word!r} (one of {', '.join(commands)})"
            parser = commands[word]
            commands, options = _tree(parser)
            known = {**known, **options}
    return None


def test_the_docs_use_only_real_commands_and_options() -> None:
    commands = documented_commands()
    assert len(commands) > 20, commands
    wrong = [(where, line, why) for where, line in commands if (why := check_command(line))]
    assert wrong == []


def test_the_checker_catches_a_wrong_command() -> None:
    assert check_command("appliancectl credentials add x") is not None
    assert check_command("appliancectl crew create NAME --allow-all") is not None
    assert check_command("appliancectl cred add NAME --provider anthropic --level L1|L2") is None


def test_docs_cli_prints_the_exit_code_table() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|", text, re.M)
    assert [(int(code), name) for code, name in rows] == [
        (code, name) for code, name, _ in exits.TABLE
    ]
