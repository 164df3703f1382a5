"""The exchange: what to do with one parsed request, decided without I/O.

Theory of operation
-------------------
The connection adapter (`proxycore/io/connection.py`) reads a request head and asks
`plan_request` what to do with it. The answer is a plan, a frozen value that names the action and
carries everything the adapter needs to carry it out, including the request's identity for the
journal (`Request`):

    Refuse       answer with a status and a readable JSON body, then keep or close
    ServeLocal   the sidecar's local API (health)
    ServeKeeper  read the body (bounded) and ask `check_keeper_call` about it
    Forward      send the request, with the head built here, to (host, port) over TLS or not;
                 the dialer checks every resolved address before it connects
    OpenTunnel   CONNECT: resolve, check, dial and relay opaque bytes
    TerminateTunnel  CONNECT to a host the crew holds a leaf for: be that host to the agent (TLS
                 with the leaf) and plan each request read inside with `tunnel=(host, port)`:
                 a forward request to (host, port) over verified TLS, every check as for one

The adapter does the I/O and comes back here with what it met: the upstream's response head
(`proxycore.protocol.responses.plan_response`), a failure (`Request.refused`, `Request.denied`:
the refusal and its terminal event come together, so the adapter emits exactly one per request
without deciding its content). Nothing in this module
awaits or touches a socket: every decision can be tested and fuzzed from bytes alone
(fuzz/fuzz_exchange.py).

The order of checks for a request (docs/proxy.md): the request form decides the route; the
journal must be able to record it (else 503 `audit_unavailable`); the name policy (mode and
exact allowlist); the declared body size; then the adapter resolves and the SSRF guard checks.
"""

from __future__ import annotations

import re
from collections.abc import Container

from proxycore.errors import PolicyDenied
from proxycore.protocol import http1, websocket
from proxycore.protocol.credentials import Provider, ProviderRoute, Routes, rewrite_for_provider
from proxycore.protocol.events import KeeperCallRefused
from proxycore.protocol.keeper import (
    KEEPER_BODY_BYTES,
    Action,
    KeeperRefused,
    check_intent,
    credential_named,
    decode_keeper_body,
    env_name,
    parse_command,
)
from proxycore.protocol.keeper_encoders import SecretSources, check_secret_encoding
from proxycore.protocol.placeholders import RULE_MISDIRECTED, misdirected_placeholder
from proxycore.protocol.plans import (
    Forward,
    OpenTunnel,
    Plan,
    Refuse,
    Request,
    ServeKeeper,
    ServeLocal,
    TerminateTunnel,
)
from proxycore.protocol.policy import RULE_NOT_IN_ALLOWLIST, CrewPolicy, parse_authority
from proxycore.protocol.refusals import local_json
from proxycore.protocol.scrubbing import IDENTITY

__all__ = [
    "AUDIT_UNAVAILABLE",
    "DRAIN_LIMIT",
    "REPLAYABLE_BODY",
    "check_keeper_call",
    "close_after_refusal",
    "keeper_refused_event",
    "plan_request",
    "refuse_unparsed",
]

# Request bodies up to this size are read whole before dialing, so a failed reused upstream
# connection can be retried on a fresh one; larger bodies stream through a fresh connection.
REPLAYABLE_BODY = 64 * 1024
# A refused request's body up to this size is read and discarded so the connection can carry
# the next request; a larger one (or one of unknown size) closes the connection instead. Never
# parsed as a request: that is how a body smuggles one (RFC 9112 9.3, 11.2).
DRAIN_LIMIT = 64 * 1024
LOCAL_PATHS = (b"/_appliance/health", b"/healthz")
# The keeper's routes of the local API (docs/keeper.md), forwarded to applianced.
KEEPER_PATHS = {b"/keeper/request": Action.REQUEST, b"/keeper/execute": Action.EXECUTE}
AUDIT_UNAVAILABLE = "audit_unavailable"  # the rule named when the journal is behind
MEMO_SIZE = 4096

_METHODS_WITH_BODY = frozenset({b"POST", b"PUT", b"PATCH"})
# Replaced by the proxy's own: the framing, and the codings the agent accepts (the proxy asks for
# identity so that the scrubber reads the response body; see proxycore/protocol/scrubbing.py).
_REQUEST_FRAMING = frozenset({b"host", b"content-length", b"expect", b"accept-encoding"})
_REQUEST_DROP = http1.compile_drop(http1.HOP_BY_HOP | _REQUEST_FRAMING)
_WEBSOCKET_DROP = http1.compile_drop(http1.HOP_BY_HOP | _REQUEST_FRAMING | websocket.WEBSOCKET_DROP)
# After "http://": the authority runs to the first "/", "?" or "#"; the path and query run to
# the fragment, which is dropped (RFC 9110 4.2.1: never sent to the origin).
_ABSOLUTE_TARGET_RE = re.compile(rb"([^/?#]*)([^#]*)")
# A request inside a terminated tunnel whose Host names another host than the tunnel's.
RULE_TUNNEL_HOST = "tunnel_host_mismatch"
_WHY_DENIED = {
    "mode_none": "crew {crew} has network mode none: no egress at all",
    "not_in_allowlist": "{host} is not on the allowlist of crew {crew}",
    "ip_shorthand": "{host} is a numeric shorthand for an address; refused",
}

# -- deciding ---------------------------------------------------------------------------------


def refuse_unparsed(crew: str, mode: str, status: int, message: str) -> Refuse:
    """A request that could not be read (bad framing, limits, a head too slow): the connection
    closes after the answer, since where the next request would start is unknown."""
    return Request(crew, mode).refused(status, "bad_request", message, close=True)


def plan_request(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    *,
    audit_blocked: bool,
    max_body: int,
    leaves: Container[str] = (),
    tunnel: tuple[str, int] | None = None,
    tunnel_tls: bool = True,
) -> Plan:
    """What to do with one request from `crew` (see the module docstring).

    `leaves`: the hosts the crew holds a leaf for (a CONNECT to one is terminated). `tunnel`:
    the request was read inside a terminated tunnel to (host, port), or (`tunnel_tls` False)
    on a captured cleartext connection to that host (proxycore/io/transparent.py)."""
    if tunnel is not None:
        return _plan_terminated(
            head,
            crew,
            routes,
            tunnel,
            audit_blocked=audit_blocked,
            max_body=max_body,
            tls=tunnel_tls,
        )
    target = head.target
    if target[:7].lower() == b"http://" and head.method != b"CONNECT":
        return _plan_forward(head, crew, routes, audit_blocked=audit_blocked, max_body=max_body)
    if target[:5].lower() == b"ws://" and head.method != b"CONNECT":
        # RFC 6455 3: a ws URI names what an http one does, for a WebSocket handshake only.
        if not websocket.wants_websocket(head):
            request = Request(crew.name, crew.mode.value, method=head.method.decode("ascii"))
            return request.refused(
                400,
                "bad_request",
                "ws:// targets are for WebSocket handshakes (GET with Upgrade: websocket)",
                close=close_after_refusal(head),
            )
        return _plan_forward(
            head, crew, routes, audit_blocked=audit_blocked, max_body=max_body, scheme_len=5
        )
    request = Request(crew.name, crew.mode.value, method=head.method.decode("ascii", "replace"))
    if head.method == b"CONNECT":
        return _plan_tunnel(head, crew, routes, request, audit_blocked=audit_blocked, leaves=leaves)
    if target[:1] == b"/":
        return _plan_origin_form(
            head, crew, routes, request, audit_blocked=audit_blocked, max_body=max_body
        )
    if target[:8].lower() == b"https://" or target[:6].lower() == b"wss://":
        return request.refused(
            400,
            "bad_request",
            f"{target.split(b':', 1)[0].decode('ascii', 'replace').lower()}:// targets must "
            "use CONNECT",
            close=close_after_refusal(head),
        )
    return request.refused(
        400,
        "bad_request",
        f"unsupported request target form for {head.method.decode('ascii', 'replace')}",
        close=True,
    )


def close_after_refusal(head: http1.RequestHead) -> bool:
    """Whether a refusal must close the connection: the agent asked to, or the request's body
    cannot be drained cheaply (unknown size, over `DRAIN_LIMIT`, or held back by 100-continue
    that a refusal never answers)."""
    if not head.keep_alive or head.expect_continue:
        return True
    if head.body_kind is http1.BodyKind.CHUNKED:
        return True
    return head.body_kind is http1.BodyKind.LENGTH and head.content_length > DRAIN_LIMIT


def _check_policy(
    head: http1.RequestHead,
    crew: CrewPolicy,
    request: Request,
    *,
    audit_blocked: bool,
    close: bool | None = None,
) -> Refuse | None:
    """The journal and the name policy; `close` None: decided by the request's body."""
    if not audit_blocked:
        decision = crew.decide(request.host, request.port)
        if decision.allowed:
            return None
    if close is None:
        close = close_after_refusal(head)
    if audit_blocked:
        # Every route (forward, reverse, tunnel) passes here before anything is dialled. Paused
        # by applianced (its journal is behind), or this worker's own events are not being
        # taken off its hands fast enough: either way, refuse rather than not record.
        return request.refused(
            503,
            "audit_unavailable",
            "the appliance cannot record requests right now (its journal is behind); "
            "nothing was sent; retry in a few seconds",
            rule=AUDIT_UNAVAILABLE,
            close=close,
        )
    why = _WHY_DENIED.get(decision.rule, "{host} refused by rule " + decision.rule)
    message = why.format(crew=crew.name, host=request.host)
    if decision.rule == RULE_NOT_IN_ALLOWLIST and crew.approval_window is not None:
        return _approval_refusal(request, crew, message, close)
    return request.denied(decision.rule, message, close=close)


def _approval_refusal(request: Request, crew: CrewPolicy, message: str, close: bool) -> Refuse:
    """A `not_in_allowlist` refusal while approvals are on: what the agent can tell its user.
    applianced files (or refreshes) the pending request from this refusal's event; a host the
    operator denied files none until the denial ends, and the refusal says denied instead."""
    host = request.host
    denied_until = crew.denied_until(host)
    if denied_until is not None:
        left = max(1, int(denied_until - crew.clock()))
        text = (
            f"{message}; the operator denied access to it ({_duration(left)} left): no "
            "approval request is filed meanwhile"
        )
        return request.denied(
            RULE_NOT_IN_ALLOWLIST, text, close=close, approval=("denied", left, None)
        )
    assert crew.approval_window is not None
    window = max(1, int(crew.approval_window))
    command = f"appliancectl approvals allow {crew.name} {host}"
    text = (
        f"{message}; an approval request for it is pending for {_duration(window)}: the "
        f"operator may run `{command}` (add --once for a while), or deny it; retry once allowed"
    )
    return request.denied(
        RULE_NOT_IN_ALLOWLIST, text, close=close, approval=("pending", window, command)
    )


def _duration(seconds: int) -> str:
    """15 minutes, 90 seconds, 2 hours: whole units when they are whole."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def _check_rules(
    head: http1.RequestHead, crew: CrewPolicy, request: Request, host: str, target: bytes
) -> Refuse | None:
    """The crew's method and path rules for `host` (proxycore.protocol.l7), on the target as it
    will be sent upstream."""
    if not crew.rules.governs(host):  # before `head.headers`, which splits every field line
        return None
    denied = crew.rules.check(host, head.method, target, head.headers)
    if denied is None:
        return None
    return request.denied(denied.rule, denied.message, close=close_after_refusal(head))


def _check_placeholders(
    head: http1.RequestHead,
    request: Request,
    destination: Provider | None,
    *,
    close: bool | None = None,
) -> Refuse | None:
    """A crew's placeholder key on its way to a host that is not its provider's route
    (proxycore.protocol.placeholders): refused, and journaled as such."""
    provider = misdirected_placeholder(head.raw, destination)
    if provider is None:
        return None
    return request.denied(
        RULE_MISDIRECTED,
        f"this request carries the appliance's placeholder for the {provider.value} key to "
        f"{request.host}: placeholders are replaced by the real key on the {provider.value} "
        "route only, and never sent anywhere else; check the client's base URL",
        close=close_after_refusal(head) if close is None else close,
    )


def _plan_tunnel(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    request: Request,
    *,
    audit_blocked: bool,
    leaves: Container[str],
) -> Plan:
    try:
        host, port = parse_authority(head.target, -1)
    except PolicyDenied as exc:
        request = request.with_target("tunnel", exc.host, 0)
        return request.denied(exc.rule, str(exc), close=True)
    request = request.with_target("tunnel", host, port)
    if head.body_kind is not http1.BodyKind.NONE:
        # RFC 9110 9.3.6: a CONNECT request has no content; one that declares some is refused
        # rather than guessed at.
        return request.refused(400, "bad_request", "CONNECT with a body", close=True)
    refused = _check_policy(head, crew, request, audit_blocked=audit_blocked, close=True)
    if refused is not None:
        return refused
    terminated = host in leaves
    if not terminated and crew.rules:
        # Its requests could not be read: a ruled host's tunnel is refused. With a leaf they
        # are read, and held to the rules one by one (`_plan_terminated`).
        denied = crew.rules.tunnel_denied(host)
        if denied is not None:
            return request.denied(denied.rule, denied.message, close=True)
    route = routes.by_host.get(host)
    refused = _check_placeholders(head, request, route.provider if route else None, close=True)
    if refused is not None:
        return refused
    return TerminateTunnel(request, host, port) if terminated else OpenTunnel(request, host, port)


def _plan_forward(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    *,
    audit_blocked: bool,
    max_body: int,
    scheme_len: int = 7,
) -> Plan:
    match = _ABSOLUTE_TARGET_RE.match(head.target, scheme_len)
    assert match is not None  # the pattern matches any bytes
    authority, path = match.groups()
    if path[:1] != b"/":
        path = b"/" + path  # "http://host?q" or "http://host"
    method = head.method.decode("ascii", "replace")
    parsed = _AUTHORITIES.get(authority)
    if parsed is None:
        try:
            parsed = _parse_forward_authority(authority)
        except PolicyDenied as exc:
            request = Request(crew.name, crew.mode.value, "forward", method, exc.host, 0)
            return request.denied(exc.rule, str(exc), close=close_after_refusal(head))
    host, port = parsed
    request = Request(crew.name, crew.mode.value, "forward", method, host, port)
    return _checked_forward(
        head, crew, routes, request, path, tls=False, audit_blocked=audit_blocked, max_body=max_body
    )


def _checked_forward(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    request: Request,
    target: bytes,
    *,
    tls: bool,
    audit_blocked: bool,
    max_body: int,
) -> Plan:
    """A forward request to `request`'s (host, port) through every check: the name policy,
    the crew's rules, the placeholders; then the plan, with the key injected on an exact
    provider host. `tls`: for any other host (a provider host is always reached over TLS)."""
    host, port = request.host, request.port
    refused = _check_policy(head, crew, request, audit_blocked=audit_blocked)
    if refused is not None:
        return refused
    if crew.rules:
        refused = _check_rules(head, crew, request, host, target)
        if refused is not None:
            return refused
    provider = routes.by_host.get(host)
    refused = _check_placeholders(head, request, provider.provider if provider else None)
    if refused is not None:
        return refused
    if provider is not None:
        # An exact provider host: always over verified TLS to the configured base URL, so the
        # credential can be injected (never onto a plain-text connection).
        return _forward(
            head,
            routes.for_crew(provider, crew.name),
            request,
            provider.host,
            provider.port,
            True,
            target,
            max_body,
        )
    return _forward(head, None, request, host, port, tls, target, max_body)


def _plan_terminated(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    tunnel: tuple[str, int],
    *,
    audit_blocked: bool,
    max_body: int,
    tls: bool = True,
) -> Plan:
    """A request read inside a terminated tunnel: a forward request to the tunnel's (host,
    port) over verified TLS, through every check a forward request passes (the name policy
    again, since it may have changed since the CONNECT; the rules; the placeholders). With
    `tls` False, a request on a captured cleartext connection: the same, over plain HTTP."""
    host, port = tunnel
    method = head.method.decode("ascii", "replace")
    request = Request(crew.name, crew.mode.value, "forward", method, host, port)
    target = head.target
    if head.method == b"CONNECT" or target[:1] != b"/":
        # Inside a tunnel the authority is the tunnel's: only origin-form (RFC 9112 3.2.1)
        # names a resource of it without a second authority to reconcile.
        return request.refused(
            400,
            "bad_request",
            "requests inside a terminated tunnel use origin-form targets (/path)",
            close=True,
        )
    named = head.get(b"host")
    if named is not None:
        try:
            # Only the host is compared, so the forward memo (default port 80) serves.
            named_host, _ = _AUTHORITIES.get(named) or _parse_forward_authority(named)
        except PolicyDenied as exc:
            return request.refused(400, "bad_request", f"bad Host field: {exc}", close=True)
        if named_host != host:
            # Domain fronting: the policy (and the leaf) were decided for the CONNECT's host; a
            # request naming another would have the upstream route it there (a shared CDN
            # edge) past that decision. 403 (denied, not malformed): the request is well-formed
            # HTTP, and the policy refuses it. The connection closes: an agent that does this is
            # not confused about one request. The port is not compared: the upstream Host is
            # always written from the tunnel's authority.
            return request.denied(
                RULE_TUNNEL_HOST,
                f"this tunnel was opened to {host}; a request in it names {named_host} "
                "(domain fronting is refused); open a tunnel to that host instead",
                close=True,
            )
    return _checked_forward(
        head,
        crew,
        routes,
        request,
        target,
        tls=tls,
        audit_blocked=audit_blocked,
        max_body=max_body,
    )


_AUTHORITIES: dict[bytes, tuple[str, int]] = {}


def _parse_forward_authority(authority: bytes) -> tuple[str, int]:
    """`policy.parse_authority` for forward requests, into the memo the caller reads first (it
    is pure; refusals are not memoized, so a hostile agent cannot fill the memo with them)."""
    parsed = parse_authority(authority, 80)
    if len(_AUTHORITIES) >= MEMO_SIZE:
        _AUTHORITIES.clear()
    _AUTHORITIES[authority] = parsed
    return parsed


def _plan_origin_form(
    head: http1.RequestHead,
    crew: CrewPolicy,
    routes: Routes,
    request: Request,
    *,
    audit_blocked: bool,
    max_body: int,
) -> Plan:
    target = head.target
    path = target.split(b"?", 1)[0]
    keep_alive = head.keep_alive
    action = KEEPER_PATHS.get(path)
    if action is not None:
        request = request.with_target("keeper", "", 0)
        close = close_after_refusal(head)
        if head.method != b"POST":
            return request.refused(
                405, "method_not_allowed", "the keeper takes POST only", close=close
            )
        if head.body_kind is http1.BodyKind.LENGTH and head.content_length > KEEPER_BODY_BYTES:
            return request.refused(
                413,
                "body_too_large",
                f"keeper request body over {KEEPER_BODY_BYTES} bytes",
                close=True,
            )
        return ServeKeeper(request, action, keep_alive)
    if path in LOCAL_PATHS:
        request = request.with_target("local", "", 0)
        response = local_json({"ok": True, "crew": crew.name, "mode": crew.mode.value})
        return ServeLocal(request, response, keep_alive)
    second = target.find(b"/", 1)
    query = target.find(b"?", 1)
    ends = [i for i in (second, query) if i != -1]
    end = min(ends) if ends else len(target)
    route = routes.by_name.get(target[1:end])
    if route is None:
        return request.with_target("reverse", "", 0).refused(
            404,
            "not_found",
            "no such route; use /anthropic/, /openai/, /google/ or a proxy request",
            close=close_after_refusal(head),
        )
    rest = target[end:]
    if rest[:1] != b"/":
        rest = b"/" + rest
    request = request.with_target("reverse", route.host, route.port)
    close = close_after_refusal(head)
    refused = _check_policy(head, crew, request, audit_blocked=audit_blocked, close=close)
    if refused is not None:
        return refused
    upstream_target = route.path_prefix.encode("ascii") + rest
    if crew.rules:
        # The path the provider will serve, its route's prefix included.
        refused = _check_rules(head, crew, request, route.host, upstream_target)
        if refused is not None:
            return refused
    refused = _check_placeholders(head, request, route.provider)
    if refused is not None:
        return refused
    return _forward(
        head,
        routes.for_crew(route, crew.name),
        request,
        route.host,
        route.port,
        True,
        upstream_target,
        max_body,
    )


def _forward(
    head: http1.RequestHead,
    provider: ProviderRoute | None,
    request: Request,
    host: str,
    port: int,
    tls: bool,
    target: bytes,
    max_body: int,
) -> Plan:
    if head.body_kind is http1.BodyKind.LENGTH and head.content_length > max_body:
        return request.refused(
            413, "body_too_large", f"request body over {max_body} bytes", close=True
        )
    authority = _HOST_FIELDS.get((host, port, tls)) or _host_field(host, port, tls)
    upgrade = head.method == b"GET" and websocket.wants_websocket(head)
    drop = _WEBSOCKET_DROP if upgrade else _REQUEST_DROP
    fields = None if provider is not None else http1.relay_fields(head, drop)
    injected: Provider | None = None
    if fields is not None:
        # The fast path: the agent's field lines as they arrived, minus the dropped ones.
        upstream = b"%s %s HTTP/1.1\r\nhost: %s%s\r\naccept-encoding: identity" % (
            head.method,
            target,
            authority,
            fields,
        )
    else:
        headers = [
            (name, value)
            for name, value in http1.strip_hop_by_hop(head.headers)
            if name not in _REQUEST_FRAMING and not (upgrade and name in websocket.WEBSOCKET_DROP)
        ]
        if provider is not None:
            target, headers, did_inject = rewrite_for_provider(provider, target, headers)
            if did_inject:
                injected = provider.provider
        headers.insert(0, (b"host", authority))
        headers.append((b"accept-encoding", IDENTITY))
        # serialize_request_head refuses a field a peer could not read back (CR, LF, NUL):
        # raises HttpProtocolError (500), which the adapter reports as an error.
        upstream = http1.serialize_request_head(head.method, target, headers)[:-4]
    forward = Forward(
        request=request,
        host=host,
        port=port,
        tls=tls,
        head=upstream,
        provider=injected,
        keep_alive=head.keep_alive,
        expect_continue=head.expect_continue,
        empty_body_length=head.method in _METHODS_WITH_BODY,
    )
    return websocket.plan_websocket(head, forward) if upgrade else forward


_HOST_FIELDS: dict[tuple[str, int, bool], bytes] = {}


def _host_field(host: str, port: int, tls: bool) -> bytes:
    """The Host field value for an upstream request, into the memo the caller reads first."""
    authority = f"[{host}]" if ":" in host else host
    if port != (443 if tls else 80):
        authority = f"{authority}:{port}"
    value = authority.encode("ascii")
    if len(_HOST_FIELDS) >= MEMO_SIZE:
        _HOST_FIELDS.clear()
    _HOST_FIELDS[(host, port, tls)] = value
    return value


# -- the keeper's routes -----------------------------------------------------------------------


def check_keeper_call(
    request: Request, action: Action, body: bytes, *, close: bool
) -> Refuse | None:
    """The worker's own checks of a keeper call before it is forwarded to applianced, which
    checks again (defence in depth, docs/keeper.md). None: forward it."""
    try:
        call = decode_keeper_body(body)
        check_intent(call.intent)
        if action is Action.EXECUTE:
            argv = parse_command(call.command)
            # applianced checks again with the paths only it knows (its store, key file).
            check_secret_encoding(argv, SecretSources((env_name(call.credential),)))
    except KeeperRefused as exc:
        return request.refused(400, exc.rule, f"keeper: {exc}", close=close)
    return None


def keeper_refused_event(
    request: Request, action: Action, body: bytes, rule: str
) -> KeeperCallRefused:
    """The keeper's own record of a call the worker refused (beside the terminal event)."""
    return KeeperCallRefused(
        crew=request.crew, action=action.value, credential=credential_named(body), rule=rule
    )
