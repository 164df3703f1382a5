"""Request rules finer than the host: which methods and paths a crew may use on a host (sans-IO).

Theory of operation
-------------------
The name policy (`proxycore.protocol.policy`) decides which hosts a crew reaches. A crew may also
carry *rules* for some of those hosts: each rule names a host, the methods it allows (or the
`read-only` preset: GET, HEAD, OPTIONS) and the paths (exact, or globs). A request to a host with
rules is allowed when at least one of that host's rules allows both its method and its path;
every other request to that host is denied (403, rule `l7_method` or `l7_path`). A host without
rules is not restricted here. Rules only narrow: they never open a host the name policy refuses.

One reading of the path. An allowlist of paths is bypassed when the proxy compares one string
and the upstream serves another: `/repos/acme/../../admin` starts with `/repos/acme/`, and so does
`/repos/acme%2F..%2F..%2Fadmin` for a server that decodes `%2F` before routing (the class of
CVE-2021-41773 in Apache httpd, CVE-2007-0450 in Tomcat, and the "..;/" path-parameter confusion
in Tomcat behind a proxy, Orange Tsai, "Breaking Parser Logic", Black Hat USA 2018). So a path is
first brought to its one canonical spelling, and anything that has a second reading is refused
(403, rule `l7_path_not_canonical`), never guessed at:

- the request-target's path is split from its query at the first `?`; a `#` is refused (RFC 9112
  3.2: no fragment in a request-target);
- every byte must be a path character of RFC 3986 3.3 (unreserved, sub-delims, `:`, `@`, `/`) or a
  percent-escape `%XX`: a space, a backslash (read as `/` by some servers), a byte >= 0x80, a
  control character or a stray `%` is refused;
- escapes of unreserved characters are decoded (`%7E` is `~`, `%2E` is `.`: RFC 3986 6.2.2.2,
  the same resource for every conforming server), the others written in upper case;
- refused: an escaped `/` or `\\` (`%2F`, `%5C`), an escaped `%` (`%25`: double encoding, read a
  second time by some frameworks), an escaped control character, escaped bytes that are not
  UTF-8 (an overlong `%C0%AE` is `.` to some decoders);
- refused: a dot-segment (`.` or `..`), also before a `;` (`..;`), also once the escapes are
  decoded and the text NFKC-folded (two fullwidth full stops, U+FF0E, are `..` to a server that
  normalizes), and an empty segment (`//`) anywhere but at the end.

Matching is on that canonical path, case-sensitive (RFC 3986 6.2.2.1: the path is): a request
spelled differently from the rule is denied, never allowed, because rules only allow. A pattern
is a path in the same canonical form where a segment may hold `*` (any characters but `/`, at
least one) and a whole segment `**` means any number of segments (none included):
`/repos/acme/**` allows `/repos/acme`, `/repos/acme/` and everything under it.

Methods are compared exactly (RFC 9110 9.1: case-sensitive). A method-override field
(`X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override`), which some servers (Google's
APIs among them) honour in place of the method, must name a method the same rule allows, or the
request is denied (rule `l7_method`).

A CONNECT to a host with rules is terminated when the crew holds a leaf certificate for that host
(docs/proxy.md, "TLS termination"), and its requests are held to the rules one by one. Without a
leaf it is refused (rule `l7_requires_termination`): an opaque tunnel's requests cannot be read,
so they cannot be held to the rules. Deny rather than not enforce.

This module is pure: no I/O. fuzz/fuzz_l7.py holds `canonical_path` and the matcher to their
invariants.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "METHOD_OVERRIDE_FIELDS",
    "READ_ONLY_METHODS",
    "RULE_METHOD",
    "RULE_NOT_CANONICAL",
    "RULE_PATH",
    "RULE_REQUIRES_TERMINATION",
    "HostRule",
    "L7Denied",
    "L7Rules",
    "NotCanonical",
    "RuleError",
    "canonical_path",
    "compile_pattern",
]

RULE_METHOD = "l7_method"
RULE_PATH = "l7_path"
RULE_NOT_CANONICAL = "l7_path_not_canonical"
RULE_REQUIRES_TERMINATION = "l7_requires_termination"

READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PRESETS = {"read-only": READ_ONLY_METHODS}
METHOD_OVERRIDE_FIELDS = (b"x-http-method-override", b"x-http-method", b"x-method-override")

# Limits on what an operator configures (a crew's rules are checked on every request to the
# host): at most this many rules per crew, paths per rule, bytes per pattern.
MAX_RULES = 256
MAX_PATHS = 64
MAX_PATTERN = 1024
# A request path longer than this is refused before it is read (RFC 9112 3: a server should
# handle 8,000 octets of request-line; the head's own limit applies first anyway).
MAX_PATH = 16 * 1024

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# Not a pchar (RFC 3986 3.3), "/" or "%" (escapes are checked one by one).
_PATH_BYTE_RE = re.compile(rb"[^A-Za-z0-9\-._~!$&'()*+,;=:@/%]")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_METHOD_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # token, RFC 9110 5.6.2


class RuleError(ValueError):
    """A rule an operator wrote that cannot be used; the message names what is wrong."""


class NotCanonical(ValueError):
    """A request path with more than one reading; the message says which part."""


@dataclass(frozen=True, slots=True)
class L7Denied:
    """Why a request was denied: the rule name for the journal and a sentence for the agent."""

    rule: str
    message: str


def canonical_path(path: bytes) -> bytes:
    """The one spelling of a request path (no query), or `NotCanonical` (module docstring)."""
    if len(path) > MAX_PATH:
        raise NotCanonical(f"path over {MAX_PATH} bytes")
    if path[:1] != b"/":
        raise NotCanonical("path does not start with /")
    bad = _PATH_BYTE_RE.search(path)
    if bad is not None:
        raise NotCanonical(f"path holds {_show(bad.group())}, which is not a path character")
    if b"%" in path:
        path = _decode_unreserved(path)
    segments = path.split(b"/")
    last = len(segments) - 1
    for index, segment in enumerate(segments[1:], 1):
        if not segment:
            if index != last:
                raise NotCanonical("path holds an empty segment (//)")
            continue
        _check_segment(segment)
    return path


def _show(byte: bytes) -> str:
    return repr(byte.decode("latin-1"))


def _decode_unreserved(path: bytes) -> bytes:
    out = bytearray()
    i, n = 0, len(path)
    while i < n:
        byte = path[i]
        if byte != 0x25:  # "%"
            out.append(byte)
            i += 1
            continue
        if i + 2 >= n:
            raise NotCanonical("path holds a % that does not begin an escape %XX")
        hi, lo = path[i + 1], path[i + 2]
        if hi not in _HEX or lo not in _HEX:
            raise NotCanonical("path holds a % that does not begin an escape %XX")
        value = int(path[i + 1 : i + 3], 16)
        if value in _UNRESERVED:
            out.append(value)
        elif value in (0x2F, 0x5C):
            raise NotCanonical("path holds an escaped / or \\ (%2F, %5C), which servers read apart")
        elif value == 0x25:
            raise NotCanonical("path holds an escaped % (%25): double encoding is refused")
        elif value < 0x20 or value == 0x7F:
            raise NotCanonical("path holds an escaped control character")
        else:
            out += b"%%%02X" % value
        i += 3
    return bytes(out)


def _check_segment(segment: bytes) -> None:
    """Refuse a segment that is a dot-segment under any reading a server may apply."""
    head = segment.split(b";", 1)[0]  # Tomcat and others drop ";params" before routing
    if head in (b".", b".."):
        raise NotCanonical("path holds a dot-segment (. or ..)")
    if b"%" not in segment and segment.isascii():
        return
    # Fully decoded: the escapes must spell UTF-8 (no overlong forms), and its NFKC form must
    # not be a dot-segment nor hold a slash.
    try:
        text = _unescape_all(segment).decode("utf-8")
    except UnicodeDecodeError:
        raise NotCanonical("path holds escaped bytes that are not UTF-8") from None
    folded = unicodedata.normalize("NFKC", text)
    if folded.split(";", 1)[0] in (".", "..") or "/" in folded or "\\" in folded:
        raise NotCanonical("path holds a segment that reads as . or .. or a slash once decoded")


def _unescape_all(segment: bytes) -> bytes:
    return re.sub(rb"%([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), segment)


_ANY_SEGMENTS = None  # a `**` segment in a PathPattern's list


class PathPattern:
    """A canonical pattern, matched segment by segment in time linear in the path for each
    pattern segment: no regex, whose backtracking on `/*-*-*-x` or `/**/**/x` against a long
    path would hold the worker's event loop for seconds (every crew it serves)."""

    __slots__ = ("_segments",)

    def __init__(self, pattern: str) -> None:
        segments: list[bytes | None] = []
        for segment in pattern.encode("ascii").split(b"/")[1:]:
            if segment == b"**":
                segments.append(_ANY_SEGMENTS)
            elif b"**" in segment:
                raise RuleError(f"path pattern {pattern!r}: ** must be a whole segment")
            else:
                segments.append(segment)
        self._segments = segments

    def fullmatch(self, path: bytes) -> bool:
        """Whether the canonical `path` matches: a `**` takes any number of segments (none
        included; the last one also takes a trailing slash and what follows), each other
        segment exactly one path segment. The classic wildcard walk, with `**` as the star and
        whole segments as its letters: it only ever goes back to the last `**`."""
        pats, segs = self._segments, path.split(b"/")[1:]
        i = j = 0
        star, mark = -1, 0
        while j < len(segs):
            if i < len(pats) and pats[i] is _ANY_SEGMENTS:
                if i == len(pats) - 1:
                    return True
                star, mark = i, j
                i += 1
                continue
            if i < len(pats) and _segment_matches(pats[i], segs[j]):  # type: ignore[arg-type]
                i += 1
                j += 1
                continue
            if star >= 0 and segs[mark]:  # a non-last `**` takes non-empty segments only
                mark += 1
                i, j = star + 1, mark
                continue
            return False
        while i < len(pats) and pats[i] is _ANY_SEGMENTS:
            i += 1
        return i == len(pats)


def _segment_matches(pattern: bytes, segment: bytes) -> bool:
    """One pattern segment against one path segment; each `*` stands for one or more bytes.
    The parts between stars are found leftmost, in order: linear in the segment per part."""
    if b"*" not in pattern:
        return pattern == segment
    parts = pattern.split(b"*")
    first, last = parts[0], parts[-1]
    if not segment.startswith(first) or not segment.endswith(last):
        return False
    pos, end = len(first), len(segment) - len(last)
    for middle in parts[1:-1]:
        # At least one byte for the star before it, and one left for the star after it.
        found = segment.find(middle, pos + 1, end - 1)
        if found < 0:
            return False
        pos = found + len(middle)
    return end - pos >= 1


def compile_pattern(pattern: str) -> PathPattern:
    """An operator's path pattern, checked and compiled; `RuleError` names the problem."""
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise RuleError(f"path pattern {pattern!r}: must start with /")
    if len(pattern) > MAX_PATTERN:
        raise RuleError(f"path pattern {pattern[:40]!r}...: over {MAX_PATTERN} characters")
    if not pattern.isascii():
        raise RuleError(f"path pattern {pattern!r}: non-ASCII (write it percent-encoded)")
    if "?" in pattern or "#" in pattern:
        raise RuleError(f"path pattern {pattern!r}: a pattern matches the path only (no ? or #)")
    # The literal parts must be canonical paths themselves: a pattern that could only match a
    # path the proxy refuses is an operator's mistake, said now rather than at the first request.
    literal = pattern.replace("**", "x").replace("*", "x").encode("ascii")
    try:
        canonical = canonical_path(literal)
    except NotCanonical as exc:
        raise RuleError(f"path pattern {pattern!r}: {exc}") from None
    if canonical != literal:
        raise RuleError(
            f"path pattern {pattern!r}: write escapes of letters, digits and -._~ as the "
            "characters, other escapes in upper case"
        )
    return PathPattern(pattern)


@dataclass(frozen=True, slots=True)
class HostRule:
    """One rule: on `host`, these methods (None: any) on these paths (empty: any)."""

    host: str
    methods: frozenset[str] | None
    paths: tuple[str, ...]
    _compiled: tuple[PathPattern, ...]

    @classmethod
    def make(
        cls,
        host: str,
        *,
        methods: Sequence[str] = (),
        preset: str | None = None,
        paths: Sequence[str] = (),
    ) -> HostRule:
        allowed: set[str] = set()
        if preset is not None:
            if preset not in PRESETS:
                raise RuleError(f"preset {preset!r}: unknown (known: {', '.join(sorted(PRESETS))})")
            allowed |= PRESETS[preset]
        for method in methods:
            if not isinstance(method, str) or not _METHOD_RE.fullmatch(method):
                raise RuleError(f"method {method!r}: not an HTTP method token")
            if method == "CONNECT":
                raise RuleError("method 'CONNECT': a rule holds the requests inside a host")
            allowed.add(method)
        if len(paths) > MAX_PATHS:
            raise RuleError(f"rule for {host}: over {MAX_PATHS} paths")
        compiled = tuple(compile_pattern(path) for path in paths)
        return cls(
            host,
            frozenset(allowed) if (methods or preset is not None) else None,
            tuple(paths),
            compiled,
        )

    def allows_method(self, method: str) -> bool:
        return self.methods is None or method in self.methods

    def allows_path(self, path: bytes) -> bool:
        return not self._compiled or any(m.fullmatch(path) for m in self._compiled)

    def describe(self) -> str:
        methods = "any method" if self.methods is None else ", ".join(sorted(self.methods))
        paths = "any path" if not self.paths else ", ".join(self.paths)
        return f"{methods} on {paths}"


class L7Rules:
    """A crew's rules by host (hosts normalized as the name policy normalizes them)."""

    __slots__ = ("_by_host",)

    def __init__(self, rules: Iterable[HostRule] = ()) -> None:
        by_host: dict[str, list[HostRule]] = {}
        for count, rule in enumerate(rules, 1):
            if count > MAX_RULES:
                raise RuleError(f"over {MAX_RULES} rules for one crew")
            by_host.setdefault(rule.host, []).append(rule)
        self._by_host = {host: tuple(found) for host, found in by_host.items()}

    def __bool__(self) -> bool:
        return bool(self._by_host)

    def governs(self, host: str) -> bool:
        """Whether requests to `host` are held to rules (then a tunnel to it is refused)."""
        return host in self._by_host

    def tunnel_denied(self, host: str) -> L7Denied | None:
        if host not in self._by_host:
            return None
        return L7Denied(
            RULE_REQUIRES_TERMINATION,
            f"{host} has method and path rules for this crew, which an opaque CONNECT tunnel "
            "cannot enforce, and the appliance holds no certificate to terminate it: the tunnel "
            "is refused",
        )

    def check(
        self,
        host: str,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> L7Denied | None:
        """None when allowed (or `host` has no rules); else why not. `target` is the
        request-target's path and query (origin-form), `headers` lower-cased names."""
        rules = self._by_host.get(host)
        if rules is None:
            return None
        name = method.decode("ascii", "replace")
        raw_path, _, _ = target.partition(b"?")
        if b"#" in target:
            return L7Denied(RULE_NOT_CANONICAL, "the request-target holds a fragment (#)")
        try:
            path = canonical_path(raw_path)
        except NotCanonical as exc:
            return L7Denied(
                RULE_NOT_CANONICAL,
                f"{host} has path rules and this path cannot be read one way only: {exc}",
            )
        overrides = [
            value.decode("ascii", "replace").strip()
            for field, value in headers
            if field in METHOD_OVERRIDE_FIELDS
        ]
        path_allowed = False
        for rule in rules:
            if not rule.allows_path(path):
                continue
            path_allowed = True
            if rule.allows_method(name) and all(rule.allows_method(o) for o in overrides):
                return None
        shown = _path_for_message(raw_path)
        allowed = "; ".join(rule.describe() for rule in rules)
        if path_allowed:
            how = name if not overrides else f"{name} (overridden to {', '.join(overrides)})"
            return L7Denied(
                RULE_METHOD,
                f"{how} {shown} on {host} refused: this crew's rules for {host} allow {allowed}",
            )
        return L7Denied(
            RULE_PATH,
            f"{name} {shown} on {host} refused: this crew's rules for {host} allow {allowed}",
        )


def _path_for_message(path: bytes) -> str:
    text = path[:200].decode("ascii", "replace")
    return text + ("..." if len(path) > 200 else "")
