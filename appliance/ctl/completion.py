"""`appliancectl completion bash|zsh|fish`: shell completion, generated from the argparse tree.

Why generated here rather than by a library: shtab writes bash and zsh but not fish, and
argcomplete runs the Python CLI on every Tab (~100 ms). Walking the parser once gives every
command path with its subcommands and options; each shell gets a small static table of those,
plus crew names (from `appliancectl crew ls -o name`) where a command takes a crew, and context
names (`appliancectl context ls -o name`) after `--context` and where a command takes one.

    bash:  source <(appliancectl completion bash)      (or into /etc/bash_completion.d/)
    zsh:   source <(appliancectl completion zsh)       (bash completion through bashcompinit)
    fish:  appliancectl completion fish > ~/.config/fish/completions/appliancectl.fish
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from . import exits
from .output import Output

SHELLS = ("bash", "zsh", "fish")
# Command paths whose first positional is a crew's name.
CREW_COMMANDS = frozenset({"crew show", "crew allow", "crew rm", "run", "cred grant"})
# Command paths whose first positional is a context's name (docs/hosts.md).
CONTEXT_COMMANDS = frozenset({"context use", "context show", "context rm", "context remove"})


def _names(path: str) -> str:
    """What `appliancectl NOUN ls -o name` lists for a positional of this command path."""
    if path in CREW_COMMANDS:
        return "crew"
    return "context" if path in CONTEXT_COMMANDS else ""


class Node:
    def __init__(self, path: str, parser: argparse.ArgumentParser | None) -> None:
        self.path = path
        self.parser = parser
        self.commands: dict[str, Node] = {}
        self.options: list[str] = []
        self.help: dict[str, str] = {}
        for action in parser._actions if parser is not None else ():
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                for name, sub in action.choices.items():
                    child = f"{path} {name}".strip()
                    self.commands[name] = Node(child, sub)
                    self.help[name] = helps.get(name, "")
            elif action.option_strings and action.help != argparse.SUPPRESS:
                self.options += [o for o in action.option_strings if o.startswith("--")]
            elif not action.option_strings and action.choices:
                # A positional with fixed values (`completion bash`): words, not commands.
                self.commands.update(
                    {str(c): Node(f"{path} {c}".strip(), None) for c in action.choices}
                )

    def walk(self) -> list[Node]:
        nodes = [self]
        for child in self.commands.values():
            if child.parser is not None:
                nodes += child.walk()
        return nodes


def tree(parser: argparse.ArgumentParser) -> list[Node]:
    return Node("", parser).walk()


def bash(parser: argparse.ArgumentParser) -> str:
    cases = []
    for node in tree(parser):
        words = " ".join([*node.commands, *node.options])
        names = _names(node.path)
        cases.append(
            f"        {shlex.quote(node.path or '-')}) words={shlex.quote(words)}; names={names} ;;"
        )
    table = "\n".join(cases)
    return f"""# appliancectl completion for bash (appliancectl completion bash)
_appliancectl() {{
    # zsh runs this through bashcompinit, which fills COMP_WORDS as a zsh array (1-based) but
    # COMP_CWORD as bash counts (0-based): index as bash does.
    [[ -n ${{ZSH_VERSION-}} ]] && setopt localoptions ksharrays
    local cur path word words names i
    cur=${{COMP_WORDS[COMP_CWORD]}}
    if ((COMP_CWORD > 1)) && [[ ${{COMP_WORDS[COMP_CWORD - 1]}} == --context ]]; then
        COMPREPLY=($(compgen -W "$(appliancectl context ls -o name 2>/dev/null)" -- "$cur"))
        return 0
    fi
    path=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${{COMP_WORDS[i]}}
        [[ $word == -- ]] && return 0
        [[ $word == -* ]] && continue
        case "${{path:+$path }}$word" in
{_bash_known(parser)}
            *) ;;
        esac
    done
    case "${{path:--}}" in
{table}
        *) words=""; names="" ;;
    esac
    if [[ $cur != -* && -n $names ]]; then
        words="$words $(appliancectl "$names" ls -o name 2>/dev/null)"
    fi
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -F _appliancectl appliancectl
"""


def _bash_known(parser: argparse.ArgumentParser) -> str:
    paths = [node.path for node in tree(parser) if node.path]
    return "\n".join(f"            {shlex.quote(p)}) path={shlex.quote(p)} ;;" for p in paths)


def zsh(parser: argparse.ArgumentParser) -> str:
    return (
        "#compdef appliancectl\n"
        "# appliancectl completion for zsh (appliancectl completion zsh): the bash one, through\n"
        "# zsh's bashcompinit.\n"
        "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser).split("\n", 1)[1]
    )


def fish(parser: argparse.ArgumentParser) -> str:
    lines = [
        "# appliancectl completion for fish (appliancectl completion fish)",
        "function __appliancectl_path",
        "    set -l path",
        "    for word in (commandline -opc)[2..-1]",
        "        string match -q -- '-*' $word; and continue",
        "        set -l next (string join ' ' $path $word)",
        "        contains -- $next $__appliancectl_paths; and set path $path $word",
        "    end",
        "    string join ' ' $path",
        "end",
        "function __appliancectl_at",
        # (a command substitution that prints nothing is no argument at all to `test`)
        "    set -l path (__appliancectl_path)",
        '    test "$path" = "$argv[1]"',
        "end",
        "complete -c appliancectl -f",
    ]
    nodes = tree(parser)
    paths = " ".join(shlex.quote(n.path) for n in nodes if n.path)
    lines.insert(1, f"set -g __appliancectl_paths {paths}")
    for node in nodes:
        condition = (
            f"__appliancectl_at {shlex.quote(node.path)}" if node.path else ("__appliancectl_at ''")
        )
        for name, child in node.commands.items():
            described = f" -d {shlex.quote(node.help.get(name, ''))}" if node.help.get(name) else ""
            del child
            lines.append(
                f"complete -c appliancectl -n {shlex.quote(condition)} -a {shlex.quote(name)}"
                + described
            )
        for option in node.options:
            lines.append(f"complete -c appliancectl -n {shlex.quote(condition)} -l {option[2:]}")
        if names := _names(node.path):
            lines.append(
                f"complete -c appliancectl -n {shlex.quote(condition)} "
                f"-a '(appliancectl {names} ls -o name 2>/dev/null)'"
            )
    lines.append(
        "complete -c appliancectl -l context -x -a '(appliancectl context ls -o name 2>/dev/null)'"
    )
    return "\n".join(lines) + "\n"


def cmd_completion(args: argparse.Namespace, out: Output) -> int:
    generate = {"bash": bash, "zsh": zsh, "fish": fish}[args.shell]
    print(generate(args.root_parser), end="", flush=True)
    return exits.OK


def add_parsers(commands: Any) -> None:
    completion = commands.add_parser(
        "completion", help="print a shell completion script (bash, zsh or fish)"
    )
    completion.add_argument("shell", choices=SHELLS)
    completion.set_defaults(func=cmd_completion)
