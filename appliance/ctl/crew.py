"""`appliancectl crew create|ls|show|allow|rm`: the crews."""

from __future__ import annotations

import argparse
from typing import Any

from appliance.daemon import messages

from . import context, exits, output
from .output import Output

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'512m', '1g', '1.5G', '536870912', '512MiB' -> bytes (binary units)."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    try:
        size = float(number) * SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512m, 2g)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return int(size)


def hosts(values: list[str]) -> tuple[str, ...]:
    """`--allow a.example --allow b.example,c.example`: every host once, in order."""
    seen: dict[str, None] = {}
    for value in values:
        for host in value.split(","):
            if host.strip():
                seen[host.strip()] = None
    return tuple(seen)


RULE_SYNTAX = "HOST [METHOD,...|read-only] [PATH ...]"


def parse_rule(text: str) -> messages.CrewRule:
    """`--rule 'api.github.com read-only /repos/acme/** /user'`: one rule in one shell word.

    The host, then an optional word of comma-separated methods (`read-only` among them is the
    preset: GET, HEAD, OPTIONS), then path patterns; a pattern starts with `/`, which is how the
    methods word is told from a path. No methods: any method; no paths: any path. applianced
    checks the rest with the proxy's own validation (docs/proxy.md)."""
    words = text.split()
    if not words:
        raise argparse.ArgumentTypeError(f"an empty rule: write {RULE_SYNTAX}")
    host, rest = words[0], words[1:]
    methods: list[str] = []
    preset: str | None = None
    if rest and not rest[0].startswith("/"):
        for item in rest.pop(0).split(","):
            if item == "read-only":
                preset = item
            elif item != item.upper() or not item:
                # Methods are case-sensitive (RFC 9110 9.1): "get" would never match a GET, so
                # it is refused here, like a misspelled preset ("readonly"), not sent as a method.
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {item!r} is neither a method in upper case (GET,POST) nor "
                    f"read-only; write {RULE_SYNTAX}"
                )
            else:
                methods.append(item)
    return messages.CrewRule(host=host, methods=tuple(methods), preset=preset, paths=tuple(rest))


def rule_spec(rule: messages.CrewRule) -> str:
    """A rule as `--rule` spells it (what `parse_rule` reads back)."""
    methods = ",".join([*([rule.preset] if rule.preset else []), *rule.methods])
    return " ".join(word for word in (rule.host, methods, *rule.paths) if word)


def rule_lines(rules: tuple[messages.CrewRule, ...]) -> list[str]:
    if not rules:
        return ["rules:    - (any method and path on the allowed hosts)"]
    return [f"{'rules:' if i == 0 else '':<10}{rule_spec(rule)}" for i, rule in enumerate(rules)]


NET_SYNTAX = "allow|deny:tcp|udp:CIDR:PORT|LOW-HIGH|*"


def net_lines(net: tuple[str, ...]) -> list[str]:
    if not net:
        return ["net:      - (nothing past the proxy)"]
    return [f"{'net:' if i == 0 else '':<10}{rule}" for i, rule in enumerate(net)]


def line(crew: messages.CrewInfo, wide: bool) -> list[str]:
    cells = [
        crew.name,
        crew.phase,
        crew.mode,
        crew.runtime,
        crew.gateway or "-",
        ",".join(crew.allow) or "-",
    ]
    if wide:
        cells += [
            crew.address or "-",
            f"{crew.memory_bytes // (1 << 20)}Mi",
            f"{crew.cpus:g}",
            (crew.agent_id or "-")[:12],
            output.clock(crew.created),
            crew.error or "",
        ]
    return cells


HEADER = ["NAME", "PHASE", "MODE", "RUNTIME", "GATEWAY", "ALLOW"]
WIDE = ["ADDRESS", "MEMORY", "CPUS", "AGENT", "CREATED", "ERROR"]


def details(crew: messages.CrewInfo) -> str:
    lines = [
        f"name:     {crew.name}",
        f"phase:    {crew.phase}" + (f" ({crew.error})" if crew.error else ""),
        f"mode:     {crew.mode}",
        f"allow:    {', '.join(crew.allow) or '-'}",
        f"reach:    {', '.join(crew.ssrf_allow) or '-'} (ssrf_allow)",
        *rule_lines(crew.rules),
        *net_lines(crew.net),
        f"runtime:  {crew.runtime}",
        f"memory:   {crew.memory_bytes // (1 << 20)} MiB",
        f"cpus:     {crew.cpus}",
        f"gateway:  {crew.gateway or '-'}  address: {crew.address or '-'}",
    ]
    for container in crew.containers:
        state = "running" if container.running else "stopped"
        lines.append(f"{container.role:<6}    {container.container_id[:12]} {state}")
    return "\n".join(lines)


def effective_allow(crew: messages.CrewInfo) -> str:
    """What the proxy lets this crew reach, each host with where it comes from (crew: its own
    allow; default: [proxy.policy] default_allow; provider: a provider's URL)."""
    if crew.mode == "free":
        return "egress:   any host (mode free; the SSRF guard still applies)"
    if crew.mode == "none":
        return "egress:   none (mode none)"
    entries = crew.effective_allow
    lines = [f"egress:   only these {len(entries)} hosts (mode restricted):"]
    width = max((len(entry.host) for entry in entries), default=0)
    lines += [f"          {entry.host:<{width}}  {', '.join(entry.sources)}" for entry in entries]
    return "\n".join(lines)


def cmd_create(args: argparse.Namespace, out: Output) -> int:
    request = messages.CreateCrew(
        name=args.name,
        mode=args.mode,
        allow=hosts(args.allow),
        runtime=args.runtime,
        memory_bytes=args.memory,
        cpus=args.cpus,
        ssrf_allow=hosts(args.ssrf_allow),
        rules=tuple(args.rule),
        net=tuple(args.net),
    )
    crew = context.client(args).create_crew(request)
    human = f"crew {crew.name} created\n" + details(crew)
    out.emit({"ok": True, "crew": crew}, human, [crew.name])
    return exits.OK


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    client = context.client(args)

    def render() -> int:
        listing = client.crews()

        def human(wide: bool) -> str:
            header = HEADER + WIDE if wide else HEADER
            return output.table(header, (line(c, wide) for c in listing.crews))

        out.emit({"ok": True, "crews": listing.crews}, human, [c.name for c in listing.crews])
        return exits.OK

    if args.watch:
        return output.watch(render, args.interval, out)
    return render()


def cmd_show(args: argparse.Namespace, out: Output) -> int:
    crew = context.client(args).crew(args.name)
    out.emit({"ok": True, "crew": crew}, details(crew) + "\n" + effective_allow(crew), [crew.name])
    return exits.OK


def cmd_allow(args: argparse.Namespace, out: Output) -> int:
    result = context.client(args).allow(args.name, args.host)
    state = "added" if result.changed else "already allowed"
    human = f"{args.host}: {state} for crew {args.name}"
    out.emit({"ok": True, **output.builtins(result)}, human, [result.host])
    return exits.OK


def cmd_net(args: argparse.Namespace, out: Output) -> int:
    result = context.client(args).set_net(args.name, tuple(args.net))
    state = "replaced" if result.changed else "unchanged"
    human = f"address rules of crew {args.name} {state}\n" + "\n".join(net_lines(result.net))
    out.emit({"ok": True, **output.builtins(result)}, human, list(result.net))
    return exits.OK


def cmd_rm(args: argparse.Namespace, out: Output) -> int:
    result = context.client(args).remove_crew(args.name)
    out.emit({"ok": True, **output.builtins(result)}, f"crew {args.name} removed", [args.name])
    return exits.OK


def add_parsers(commands: Any, leaf: Any, watchable: Any) -> None:
    crew = commands.add_parser("crew", help="manage crews")
    crews = crew.add_subparsers(dest="crew_command", required=True, metavar="COMMAND")
    create = leaf(crews.add_parser("create", help="create a crew and start its agent container"))
    create.add_argument("name")
    create.add_argument("--mode", default="restricted", help="free, restricted (default) or none")
    # One value per --allow (repeatable, or comma-separated): nargs="+" would take the crew's
    # name too when it follows (`crew create --allow a.example b.example NAME`).
    create.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="an allowed host (repeatable, or comma-separated)",
    )
    create.add_argument("--runtime", help="container runtime (default: the configured one)")
    create.add_argument("--memory", type=parse_size, help="memory limit, e.g. 512m, 2g")
    create.add_argument("--cpus", type=float, help="CPU limit, e.g. 0.5, 2")
    create.add_argument(
        "--ssrf-allow",
        action="append",
        default=[],
        metavar="CIDR",
        help="a destination range only this crew may reach although the SSRF guard refuses it, "
        "the appliance host's own addresses included (repeatable; docs/proxy.md)",
    )
    create.add_argument(
        "--rule",
        action="append",
        default=[],
        type=parse_rule,
        metavar="'HOST [METHODS|read-only] [PATH ...]'",
        help="methods and paths allowed on a host, in one shell word, e.g. "
        "'api.github.com read-only /repos/acme/**' (repeatable: a request to a host with rules "
        "must match one; they narrow --allow, never widen it; docs/cli.md)",
    )
    create.add_argument(
        "--net",
        action="append",
        default=[],
        metavar=NET_SYNTAX,
        help="an address rule past the proxy, enforced by the kernel and the proxy, e.g. "
        "allow:tcp:10.9.0.0/24:5432, allow:udp:10.9.0.53/32:53, deny:tcp:10.9.0.66/32:* "
        "(repeatable; deny wins; UDP leaves only where an allow rule names it; docs/netns.md)",
    )
    create.set_defaults(func=cmd_create)
    watchable(leaf(crews.add_parser("ls", help="list crews"))).set_defaults(func=cmd_ls)
    show = leaf(crews.add_parser("show", help="one crew in detail"))
    show.add_argument("name")
    show.set_defaults(func=cmd_show)
    allow = leaf(crews.add_parser("allow", help="allow a host for a crew, at run time"))
    allow.add_argument("name")
    allow.add_argument("host")
    allow.set_defaults(func=cmd_allow)
    net = leaf(crews.add_parser("net", help="replace a crew's address rules, at run time (--net)"))
    net.add_argument("name")
    net.add_argument(
        "--net",
        action="append",
        default=[],
        metavar=NET_SYNTAX,
        help="an address rule, as for crew create (repeatable; every rule the crew is to have: "
        "none clears them)",
    )
    net.set_defaults(func=cmd_net)
    rm = leaf(crews.add_parser("rm", help="remove a crew (containers, network, proxy)"))
    rm.add_argument("name")
    rm.set_defaults(func=cmd_rm)
