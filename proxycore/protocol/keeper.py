"""The keeper's validation rules: the L1 fast path and the execute command check (sans-IO).

Theory of operation
-------------------
An agent asks the keeper for a credential in one of two ways, both on its crew gateway's local
API: `request` (deliver the value, for an intent) and `execute` (run a command with the value in
that command's environment; the agent sees only the scrubbed output). Before any model is asked,
this module decides what can be decided from the text alone, identically in the proxy worker
and in applianced (defence in depth: applianced never trusts the worker's check):

1. `check_intent`: the intent is text of at most 4096 characters without NUL; empty and
   whitespace-only intents are refused before they reach the model (source: "Empty or
   whitespace-only intents are rejected before they reach the LLM").
2. `fast_path_allows`: the L1 fast path, exactly as the source documents state it: `request`
   only (never `execute`, so a command can never be smuggled through it), an L1 credential, and
   an intent with at least 10 non-whitespace and at least 3 distinct non-whitespace characters.
   Filler ("aaaaaaaaaa", "ab ab ab ab") does not qualify; it is not refused here but goes to
   the gatekeeper model like every other request that is not fast-pathed.
3. `parse_command`: the execute command is at most 4096 characters, has no NUL, and has none
   of the shell metacharacters `;` `|` `&` (alone or doubled) backquote `>` `<` (so `<(` and
   here-docs too) `$(` newline carriage return outside single quotes. It is then split into an
   argv with POSIX shlex rules (single quotes literal, double quotes with `\\"` and `\\\\`,
   backslash outside quotes escapes the next character) in the same single pass that checks the
   metacharacters, so the check and the split can never disagree about what is quoted. The argv
   is executed without a shell: nothing is ever expanded (`$HOME` stays the five characters).

The stricter-than-listed choices: other ASCII control characters (except tab) are refused
outside single quotes too, an unterminated quote or a trailing backslash is refused, and double
quotes protect nothing (a metacharacter inside "..." is refused, as in the source's rule "content
inside single quotes is exempt" and nothing else).

`KeeperRefused` is the only exception this module raises; it carries a stable `rule` name and
the HTTP status the gateway answers with.
"""

from __future__ import annotations

import enum
import itertools
import re
import unicodedata
from typing import TYPE_CHECKING

import msgspec

from proxycore.errors import ProxyError

if TYPE_CHECKING:
    from native.scrub import Scrubber

MAX_FIELD_LENGTH = 4096
FAST_PATH_MIN_NON_WHITESPACE = 10
FAST_PATH_MIN_DISTINCT = 3

RULE_EMPTY_INTENT = "empty_intent"
RULE_TOO_LONG = "too_long"
RULE_NUL_BYTE = "nul_byte"
RULE_EMPTY_COMMAND = "empty_command"
RULE_METACHARACTER = "shell_metacharacter"
RULE_CONTROL_CHARACTER = "control_character"
RULE_UNTERMINATED_QUOTE = "unterminated_quote"
RULE_TRAILING_BACKSLASH = "trailing_backslash"
RULE_NOT_TEXT = "not_text"

# Refused outside single quotes. `&&`, `||`, `>>`, `<<` (here-docs) and `<(` are covered by
# their first character; `$(` is the only two-character sequence whose parts are harmless alone.
METACHARACTERS = frozenset(";|&`><\n\r")
COMMAND_SUBSTITUTION = "$("
_WORD_SEPARATORS = frozenset(" \t")
_NAME_TO_ENV = re.compile(r"[^A-Z0-9]")


def env_name(credential: str) -> str:
    """The environment variable an execute's command finds the value in: github-token ->
    GITHUB_TOKEN (documented in docs/keeper.md); the worker's encoder rule needs it too."""
    name = _NAME_TO_ENV.sub("_", credential.upper())
    return name if name[:1].isalpha() else "CREDENTIAL_" + name


class KeeperRefused(ProxyError):
    """The keeper refused the request before asking any model; `rule` names why."""

    status_hint = 400

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message)
        self.rule = rule


class Action(enum.Enum):
    REQUEST = "request"
    EXECUTE = "execute"


class Level(enum.Enum):
    """A credential's security level (mirrors the credential store's levels by value)."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"


def _check_text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise KeeperRefused(f"{field} must be a string", rule=RULE_NOT_TEXT)
    if len(value) > MAX_FIELD_LENGTH:
        raise KeeperRefused(
            f"{field} is {len(value)} characters, the limit is {MAX_FIELD_LENGTH}",
            rule=RULE_TOO_LONG,
        )
    if "\x00" in value:
        raise KeeperRefused(f"{field} contains a NUL character", rule=RULE_NUL_BYTE)
    return value


def _counts_as_content(char: str) -> bool:
    # Whitespace and invisible characters (format, control, unassigned: zero-width spaces,
    # BOMs, bidi marks) say nothing, so they count toward neither threshold.
    return not char.isspace() and unicodedata.category(char)[0] not in {"C", "Z"}


def check_intent(intent: object) -> str:
    """Return the intent if it may be evaluated at all; refuse empty or whitespace-only ones."""
    text = _check_text(intent, "intent")
    if not any(_counts_as_content(char) for char in text):
        raise KeeperRefused("intent is empty or whitespace only", rule=RULE_EMPTY_INTENT)
    return text


def intent_is_substantive(intent: str) -> bool:
    """At least 10 non-whitespace and at least 3 distinct non-whitespace characters."""
    content = [char for char in intent if _counts_as_content(char)]
    # Case folded, so "aAaAaAaAaA" is the filler it looks like.
    distinct = {char.casefold() for char in content}
    return len(content) >= FAST_PATH_MIN_NON_WHITESPACE and len(distinct) >= FAST_PATH_MIN_DISTINCT


def fast_path_allows(action: Action, level: Level, intent: str) -> bool:
    """The L1 fast path: True means ALLOW without a model round-trip."""
    return action is Action.REQUEST and level is Level.L1 and intent_is_substantive(intent)


def _refuse_character(char: str, position: int) -> KeeperRefused:
    if char in METACHARACTERS:
        return KeeperRefused(
            f"command has the shell metacharacter {char!r} at {position} outside single quotes",
            rule=RULE_METACHARACTER,
        )
    return KeeperRefused(
        f"command has the control character {char!r} at {position} outside single quotes",
        rule=RULE_CONTROL_CHARACTER,
    )


def _is_refused_outside_single_quotes(char: str) -> bool:
    return char in METACHARACTERS or (char != "\t" and (char < " " or char == "\x7f"))


class _Quote(enum.Enum):
    NONE = enum.auto()
    SINGLE = enum.auto()
    DOUBLE = enum.auto()


def _finish_word(word: list[tuple[str, int | None]], position: int) -> str:
    # A "$(" is accepted only if it was written as "$(" inside one single-quoted segment: a `$`
    # and a `(` glued together from different quoting ('$'"(" or $\() are refused, so no argv
    # word ever carries a "$(" that single quotes did not protect as such.
    for (char, segment), (following, next_segment) in itertools.pairwise(word):
        if char + following == COMMAND_SUBSTITUTION and (
            segment is None or segment != next_segment
        ):
            raise KeeperRefused(
                f"command forms '$(' outside single quotes in the word ending at {position}",
                rule=RULE_METACHARACTER,
            )
    return "".join(char for char, _ in word)


def parse_command(command: object) -> tuple[str, ...]:
    """Check an execute command and split it into an argv (never for a shell)."""
    text = _check_text(command, "command")
    argv: list[str] = []
    # Each character with the single-quoted segment it came from (None: not single-quoted).
    word: list[tuple[str, int | None]] = []
    in_word = False  # distinguishes '' (an empty argument) from no argument at all
    quote = _Quote.NONE
    segment = 0
    index = 0
    length = len(text)
    while index < length:
        char = text[index]
        if quote is _Quote.SINGLE:
            if char == "'":
                quote = _Quote.NONE
            else:
                word.append((char, segment))
            index += 1
            continue
        # Outside single quotes (bare or double-quoted): every refusal applies.
        if _is_refused_outside_single_quotes(char):
            raise _refuse_character(char, index)
        if text.startswith(COMMAND_SUBSTITUTION, index):
            raise KeeperRefused(
                f"command has '$(' at {index} outside single quotes", rule=RULE_METACHARACTER
            )
        if quote is _Quote.DOUBLE:
            if char == '"':
                quote = _Quote.NONE
            elif char == "\\" and index + 1 < length and text[index + 1] in '"\\':
                word.append((text[index + 1], None))
                index += 1
            else:
                word.append((char, None))
        elif char in _WORD_SEPARATORS:
            if in_word:
                argv.append(_finish_word(word, index))
                word.clear()
                in_word = False
        elif char == "'":
            quote, in_word = _Quote.SINGLE, True
            segment += 1
        elif char == '"':
            quote, in_word = _Quote.DOUBLE, True
        elif char == "\\":
            if index + 1 >= length:
                raise KeeperRefused("command ends with a backslash", rule=RULE_TRAILING_BACKSLASH)
            escaped = text[index + 1]
            # An escaped metacharacter is still refused: the rule exempts single quotes only.
            if _is_refused_outside_single_quotes(escaped):
                raise _refuse_character(escaped, index + 1)
            word.append((escaped, None))
            in_word = True
            index += 1
        else:
            word.append((char, None))
            in_word = True
        index += 1
    if quote is not _Quote.NONE:
        raise KeeperRefused("command has an unterminated quote", rule=RULE_UNTERMINATED_QUOTE)
    if in_word:
        argv.append(_finish_word(word, length))
    if not argv:
        raise KeeperRefused("command is empty", rule=RULE_EMPTY_COMMAND)
    return tuple(argv)


# -- a keeper call's body ------------------------------------------------------------------


KEEPER_BODY_BYTES = 16 * 1024


class KeeperBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A keeper call's JSON body, as both the proxy worker and applianced read it.

    Decoded against this flat schema, never as free JSON: a nested value where a string belongs,
    or an unknown field, is refused at its first byte, so no body (1 KiB of "[[[[" included)
    can make the decoder recurse (RFC 8259 9 lets a parser limit nesting; this one allows
    none).
    """

    credential: str
    intent: str
    command: str | None = None  # execute only
    agent: str | None = None


class _Named(msgspec.Struct):
    credential: str | None = None


def decode_keeper_body(body: bytes) -> KeeperBody:
    """The body, or KeeperRefused("bad_body") naming what is wrong (never the value)."""
    if len(body) > KEEPER_BODY_BYTES:
        raise KeeperRefused(f"body over {KEEPER_BODY_BYTES} bytes", rule=RULE_TOO_LONG)
    try:
        return msgspec.json.decode(body, type=KeeperBody)
    except msgspec.DecodeError as exc:
        raise KeeperRefused(f"bad keeper body: {exc}", rule="bad_body") from None
    except RecursionError:  # not reached with this schema; kept so it can never escape
        raise KeeperRefused("bad keeper body: nested too deep", rule="bad_body") from None


def credential_named(body: bytes) -> str:
    """The credential a body names, for the record of a refused call ("" if none readable)."""
    try:
        named = msgspec.json.decode(body[:KEEPER_BODY_BYTES], type=_Named).credential
    except (msgspec.DecodeError, RecursionError):
        return ""
    return named[:64] if named else ""


# -- applianced's answer, on its way back to the crew ----------------------------------------

# What applianced answers (appliance/keeper/service.py `Answer`): flat, text, numbers, flags and
# the list of withheld pipes. Decoded against this type, never as free JSON.
_AnswerFields = dict[str, str | int | bool | list[str] | None]
# The one field never scrubbed: a granted `request` exists to deliver that value.
DELIVERED_FIELD = "value"


def scrub_keeper_answer(scrubber: Scrubber, action: Action, answer: bytes) -> bytes | None:
    """applianced's answer with the proxy's secrets redacted from every text field but a
    `request`'s delivered value; None if it is not the answer expected (the worker then
    answers 503).

    applianced scrubs an execute's output with every value of the credential store; the proxy
    also holds keys applianced never sees (a provider's `credential_env`/`credential_file`, and
    values rotated away), so the output passes through the proxy's scrubber too, the one its
    responses go through."""
    try:
        fields = msgspec.json.decode(answer, type=_AnswerFields)
    except msgspec.DecodeError:
        return None
    changed = False
    for key, item in fields.items():
        delivered = action is Action.REQUEST and key == DELIVERED_FIELD
        if not delivered and isinstance(item, str):
            scrubbed = scrubber.scrub_text(item)
            if scrubbed != item:
                fields[key] = scrubbed
                changed = True
    return msgspec.json.encode(fields) if changed else answer
