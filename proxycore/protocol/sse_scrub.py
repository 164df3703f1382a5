"""Server-sent events through the scrubber, one text channel at a time (sans-IO).

Theory of operation: a streamed model response spells its text out a few bytes per event
(`"text":"sk-a"` ... `"text":"nt-a"`), and the client's SDK concatenates the deltas. The byte
scrubber sees each piece between JSON punctuation and never the whole key; this layer gives it
the text as the SDK will see it.

1. Framing (WHATWG HTML, "Server-sent events", 9.2.6 "Interpreting an event stream"): lines end
   in CRLF, LF or CR; a blank line ends an event; `data:` lines (one leading space dropped) are
   joined with LF. An event is held whole until its blank line, at most `MAX_EVENT`
   bytes: a longer one is relayed as it arrives, unparsed (if events wait, the channels they
   wait on are flushed first, so that the order of events is kept).
2. Channels: the JSON `data` of the Anthropic Messages stream (`content_block_start`'s text,
   `content_block_delta` with `text_delta.text`, `input_json_delta.partial_json`,
   `thinking_delta.thinking`; one channel per kind across the message's blocks, as the SDK
   joins text blocks), of OpenAI chat completions (per choice: every string of `delta` at
   every depth but `index` and `type`, one channel per path, as the SDK's stream helper
   accumulates them -- content, reasoning, refusal, tool calls' arguments --, and legacy
   `text`) and of the OpenAI Responses API (every `response.*.delta` event with a string
   `delta`, one channel per event type across items, as `output_text` joins them) names text
   channels. Each channel has its own scrubber stream (`Scrubber.stream()`) fed the
   *concatenation* of its texts, so the scrubber sees what the SDK assembles. Only what the
   SDK joins goes in (text in between would hide a key the SDK joins), and what could be
   joined two ways is refused: the parts (blocks, items) of a channel interleaved, a choice or
   tool-call index that is not an integer, a text that is not valid UTF-8 (`HttpProtocolError`).
3. Holding back: an event whose text the channel's stream still holds (`pending`: its last
   bytes could begin a secret) waits, and every event after it waits behind it (events go out
   in order); nothing else is delayed. A channel ends -- its stream is flushed and the events
   waiting on it go out -- at the end of what the SDK joins (`message_stop`, a choice's
   `finish_reason`, `[DONE]`, `response.completed` / `incomplete` / `failed`, an `error`
   event) or the body's end. Text for a channel after its end is refused (the stream is cut):
   no provider sends it, and a key split around the end would otherwise pass in two pieces.
4. Rewriting (sse_channels.py): each release of a channel's stream maps the input it released
   onto the output.
   Where they are equal, each event keeps its own text. Where the scrubber redacted, the bytes
   before the first marker and after the last one map one to one; the changed middle goes to
   the event where it starts (that event carries `[REDACTED:<name>]`) and the events wholly
   inside it carry an empty text. Whatever the split, the concatenation of the events' texts is
   exactly the scrubber's output for the concatenated text, so the SDK assembles the marker
   where the key was and never the key. A rewritten event is its `data` re-serialized (valid
   JSON, every other field kept, on one `data:` line where the first one was; the other lines
   of the event are kept as they were); an event not rewritten goes out byte for byte.
5. The bytes that go out still pass through the ordinary byte scrubber (other fields, events
   this layer cannot parse, a secret whole inside one event), each event whole as it is let go
   (never held for the next one).

Bounds: an event being read is at most `MAX_EVENT` bytes; the events waiting behind a held text
at most `MAX_HELD` bytes and the channels open at most `MAX_CHANNELS` (more is a stream that
will not resolve: it is cut with `HttpProtocolError`, never held on); each channel's stream
holds what the scrubber bounds (`Patterns.hold_bound_bytes`). JSON is parsed by msgspec, and by
`json.loads` (what the Python SDKs use) where msgspec refuses (a lone surrogate escape); nesting
too deep for both is caught: such an event is relayed unparsed (the SDK cannot read it either).
A text that is not valid UTF-8 cuts the stream: a client that replaces the bad bytes and one
that skips the event would join different texts.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import msgspec

from native.scrub import Scrubber
from proxycore.errors import HttpProtocolError
from proxycore.protocol.sse_channels import Channel, Slot

__all__ = ["MAX_CHANNELS", "MAX_EVENT", "MAX_HELD", "SseScrubber", "is_event_stream"]

MAX_EVENT = 256 * 1024
MAX_HELD = 1024 * 1024
# Channels open at once: OpenAI's `n` is at most 128 choices, each a few texts and tool calls.
MAX_CHANNELS = 1024
# How deep the strings of a chat delta are followed (tool_calls[j].function.arguments is 3).
_MAX_DEPTH = 8

# One line terminator, CRLF taken whole (the atomic group never gives its LF back, so "a\r\nb"
# is not read as CR + LF-blank-line).
_TERMINATOR = re.compile(rb"(?>\r\n|\r|\n)")
# The end of an event: a line's terminator followed by an empty line's.
_EVENT_END = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")
# A `data` line's value in an event whose lines all end in LF (9.2.6: "data", "data:v",
# "data: v"; a field name that merely begins with "data" is another field).
_DATA_LF = re.compile(rb"(?m)^data(?::(?: )?(.*))?$")
_BOM = b"\xef\xbb\xbf"
_DELTA_FIELDS = {
    "text_delta": "text",
    "input_json_delta": "partial_json",
    "thinking_delta": "thinking",
}

ChannelKey = tuple[Hashable, ...]


def is_event_stream(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"text/event-stream"


def _key(value: object) -> Hashable:
    """A JSON value as part of a channel key (ints and short strings as they are)."""
    if isinstance(value, int | str) and not isinstance(value, bool):
        return value if not isinstance(value, str) or len(value) <= 256 else value[:256]
    return repr(value)[:256]


def _integer(value: object) -> int:
    """A choice's or tool call's index: an SDK keys its texts by it, and one that is not a
    plain integer may be read apart or together ("0" and 0) -- no one channel serves both."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise HttpProtocolError("a server-sent event's choice index is not an integer", status_hint=502)


class _Event:
    __slots__ = ("obj", "raw", "slots")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.obj: Any = None
        self.slots: list[Slot] = []

    def ready(self) -> bool:
        return all(slot.new is not None for slot in self.slots)

    def render(self) -> bytes:
        changed = False
        for slot in self.slots:
            if slot.new != slot.old:
                assert slot.new is not None
                slot.container[slot.field] = _text(slot.new)
                changed = True
        if not changed:
            return self.raw
        try:
            data = msgspec.json.encode(self.obj)  # compact, valid (a NaN becomes null)
        except (msgspec.EncodeError, UnicodeEncodeError, OverflowError, TypeError):
            # A lone surrogate (from a \ud800 escape) or an integer too large: escaped by json.
            data = json.dumps(self.obj, separators=(",", ":")).encode()
        raw = self.raw
        lines = []
        pos = 0
        for match in _TERMINATOR.finditer(raw):
            lines.append((raw[pos : match.start()], match.group()))
            pos = match.end()
        if pos < len(raw):  # an event the body ended without its blank line
            lines.append((raw[pos:], b""))
        out = bytearray()
        placed = False
        for line, end in lines:
            if line and _field(line)[0] == b"data":
                if not placed:
                    out += b"data: " + data + end
                    placed = True
                continue
            out += line + end
        return bytes(out)


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # a redaction cut a character: what is left of it is replaced
        return raw.decode("utf-8", "replace")


def _is_data(line: bytes) -> bool:
    if line.startswith(_BOM):
        line = line[3:]
    return line.startswith(b"data") and (len(line) == 4 or line[4:5] == b":")


def _field(line: bytes) -> tuple[bytes, bytes]:
    """A line's field name and value (WHATWG 9.2.6): one space after the colon is dropped."""
    if line.startswith(_BOM):
        line = line[3:]
    name, colon, value = line.partition(b":")
    if colon and value.startswith(b" "):
        value = value[1:]
    return name, value


class SseScrubber:
    """Feed a decoded `text/event-stream` body; get the bytes to relay, scrubbed per channel and
    by the byte scrubber. `flush` at the body's end."""

    __slots__ = (
        "_buf",
        "_bytes",
        "_channels",
        "_dirty",
        "_ended",
        "_held",
        "_max_event",
        "_max_held",
        "_out",
        "_parts",
        "_passing",
        "_queue",
        "_scanned",
        "_scrubber",
    )

    def __init__(
        self, scrubber: Scrubber, *, max_event: int = MAX_EVENT, max_held: int = MAX_HELD
    ) -> None:
        self._scrubber = scrubber
        self._bytes = scrubber.stream()
        self._channels: dict[ChannelKey, Channel] = {}
        self._dirty: list[Channel] = []  # channels with texts added in this read
        self._ended: set[ChannelKey] = set()  # channels the stream ended (no text may follow)
        # Per channel joining parts: the part taking text now, and the parts done.
        self._parts: dict[ChannelKey, tuple[Hashable, set[Hashable]]] = {}
        self._queue: deque[_Event] = deque()
        self._held = 0  # raw bytes of the events in `_queue`
        # For the byte scrubber, in order, at the end of the read: (bytes, ends an event).
        self._out: list[tuple[bytes, bool]] = []
        self._buf = bytearray()  # the event being read
        self._scanned = 0  # how far `_buf` was searched for an event end
        self._passing = False  # relaying an event over `max_event` as it comes
        self._max_event = max_event
        self._max_held = max_held

    @property
    def pending(self) -> int:
        """Bytes held: the event being read, events waiting, the byte scrubber's tail."""
        return len(self._buf) + self._held + self._bytes.pending

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        self._take_events(eof=False)
        self._emit()
        if self._held > self._max_held:
            raise HttpProtocolError(
                f"server-sent events held over {self._max_held} bytes behind a text the "
                "scrubber could not yet decide",
                status_hint=502,
            )
        return self._scrubbed()

    def flush(self) -> bytes:
        self._take_events(eof=True)
        if self._buf and not self._passing:
            # An event the body ends without its blank line: WHATWG clients drop it, but one
            # that dispatches it anyway must not see a key in it either, so it is read too.
            self._enqueue(self._parse(bytes(self._buf)))
            self._buf.clear()
        self._close_all()
        self._emit()
        if self._buf:  # the end of an event too long to hold: relayed as it came
            self._out.append((bytes(self._buf), True))
            self._buf.clear()
        return self._scrubbed() + self._bytes.flush()

    def _scrubbed(self) -> bytes:
        """The byte scrubber over what this read let go, one event at a time: each event is
        scrubbed whole (a client reads an event's fields together, and the texts it joins
        across events are the channels' work), so a complete event is never held back waiting
        for the next one, as a stream over all the events would hold the end of each (the fold
        matcher keeps up to 15 letters and digits that may begin a key). An event too long to
        hold goes through a stream as it arrives, flushed at its end."""
        out = self._out
        if not out:
            return b""
        self._out = []
        scrubber, stream = self._scrubber, self._bytes
        parts: list[bytes] = []
        for data, ends_event in out:
            if ends_event and not stream.pending:
                parts.append(scrubber.scrub(data))
                continue
            parts.append(stream.feed(data))
            if ends_event:
                parts.append(stream.flush())
                self._bytes = stream = scrubber.stream()
        return b"".join(parts)

    # -- framing ---------------------------------------------------------------------------

    def _take_events(self, *, eof: bool) -> None:
        buf = self._buf
        while buf:
            if self._passing:
                match = _EVENT_END.search(buf, max(0, self._scanned - 2))
                if match is None:
                    take = max(0, len(buf) - (0 if eof else 2))
                    self._out.append((bytes(buf[:take]), False))
                    del buf[:take]
                    self._scanned = len(buf)
                    return
                self._out.append((bytes(buf[: match.end()]), True))
                del buf[: match.end()]
                self._passing = False
                self._scanned = 0
                continue
            # Every event this read completed, in one pass. Blank lines before an event are
            # read as part of it (they dispatch nothing, 9.2.6), and an event that ends in a CR
            # goes now: if an LF follows (CRLF), it is such a blank line.
            data = bytes(buf)
            pos = 0
            for match in _EVENT_END.finditer(data, max(0, self._scanned - 2)):
                end = match.end()
                self._enqueue(self._parse(data[pos:end]))
                pos = end
            if pos:
                del buf[:pos]
            self._scanned = len(buf)
            if len(buf) <= self._max_event:
                return
            # Too long to hold: it goes out as it comes, through the byte scrubber only. The
            # events waiting go first; the channels they wait on are flushed for that (with
            # nothing waiting, no channel holds anything and they carry on).
            self._emit()
            if self._queue:
                self._close_all(ended=False)  # their texts may go on after this event
                self._emit()
            self._passing = True

    def _parse(self, raw: bytes) -> _Event:
        event = _Event(raw)
        if b"\r" not in raw and not raw.startswith(_BOM):
            data = _DATA_LF.findall(raw)  # the common case, in one call
        else:
            lines = _LINE_BREAK.split(raw)
            data = [_field(line)[1] for line in lines if b"data" in line[:7] and _is_data(line)]
        if not data:
            return event
        text = data[0] if len(data) == 1 else b"\n".join(data)
        if text.strip() == b"[DONE]":
            self._close_all()
            return event
        if text.lstrip()[:1] != b"{":
            return event
        lossy = False
        try:
            obj = msgspec.json.decode(text)
        except (msgspec.DecodeError, ValueError, RecursionError):
            # What msgspec refuses and json takes (a lone surrogate escape; invalid UTF-8, read
            # with replacement characters), or nothing can read.
            try:
                decoded = text.decode("utf-8")
            except UnicodeDecodeError:
                decoded, lossy = text.decode("utf-8", "replace"), True
            try:
                obj = json.loads(decoded)
            except (ValueError, RecursionError):
                return event
        if isinstance(obj, dict):
            event.obj = obj
            self._classify(event, obj)
            if lossy and event.slots:
                # A client that replaces the bad bytes joins this text, one that skips the
                # event does not: no one concatenation serves both, and no provider sends it.
                raise HttpProtocolError(
                    "a server-sent event's text is not valid UTF-8", status_hint=502
                )
        return event

    # -- channels --------------------------------------------------------------------------

    def _classify(self, event: _Event, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if isinstance(kind, str):
            # Anthropic: one channel per kind of text across the message's blocks (the SDK's
            # `get_final_text` joins the text blocks), flushed at the message's end. Only what
            # the SDK joins goes in (a delta of another type is not part of any text), and the
            # blocks must come one after the other (else a block's own text would not be one
            # piece of the channel's).
            if kind == "content_block_delta":
                delta = obj.get("delta")
                if isinstance(delta, dict):
                    field = _DELTA_FIELDS.get(str(delta.get("type")))
                    if field is not None and isinstance(delta.get(field), str):
                        self._in_order(("a", field), obj.get("index"))
                        self._slot(event, ("a", field), delta, field)
                return
            if kind == "content_block_start":
                self._block_text(event, obj.get("content_block"), obj.get("index"))
                return
            if kind == "message_start":  # the SDK's snapshot starts from its content
                message = obj.get("message")
                blocks = message.get("content") if isinstance(message, dict) else None
                for position, block in enumerate(blocks if isinstance(blocks, list) else ()):
                    self._block_text(event, block, position)
                return
            if kind in ("message_stop", "error"):
                self._close_all()
                return
            if kind.startswith("response."):
                self._responses(event, obj, kind)
                return
        choices = obj.get("choices")
        if isinstance(choices, list):
            self._chat(event, choices)

    def _block_text(self, event: _Event, block: Any, index: Any) -> None:
        if isinstance(block, dict):
            field = {"text": "text", "thinking": "thinking"}.get(str(block.get("type")))
            if field is not None and isinstance(block.get(field), str):
                self._in_order(("a", field), index)
                self._slot(event, ("a", field), block, field)

    def _in_order(self, channel: ChannelKey, part: Any) -> None:
        """A channel joining parts (blocks, items) takes them one after the other: a part that
        comes back after another began is refused."""
        part = _key(part)
        current = self._parts.get(channel)
        if current is None:
            self._parts[channel] = (part, set())
        elif current[0] != part:
            done = current[1]
            if part in done or len(done) >= MAX_CHANNELS:
                raise HttpProtocolError(
                    "server-sent events interleave the parts of one text", status_hint=502
                )
            done.add(current[0])
            self._parts[channel] = (part, done)

    def _chat(self, event: _Event, choices: list[Any]) -> None:
        ended: list[Hashable] = []
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            raw_index = choice.get("index", position)
            index = _key(raw_index)
            before = len(event.slots)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta_strings(event, ("c", index), delta, 0)
            self._slot(event, ("c", index, "text"), choice, "text")
            if len(event.slots) > before:
                _integer(raw_index)
            if choice.get("finish_reason") is not None:
                ended.append(index)
        if ended:
            self._close(lambda key: key[0] == "c" and key[1] in ended)

    def _delta_strings(
        self, event: _Event, path: ChannelKey, delta: dict[Any, Any], depth: int
    ) -> None:
        """Every string of a chat delta, one channel per path, as the OpenAI SDK's stream
        helper accumulates them (`openai.lib.streaming._deltas.accumulate_delta`): strings
        concatenated at every depth (content, reasoning, refusal, tool calls' and the legacy
        function_call's name and arguments, audio transcripts, ...) but `index` and `type`;
        objects merged; a list of objects merged entry by entry by their `index`."""
        if depth > _MAX_DEPTH:
            raise HttpProtocolError("a server-sent event's delta nests too deep", status_hint=502)
        for name, value in delta.items():
            if name in ("index", "type"):
                continue
            if isinstance(value, str):
                self._slot(event, (*path, name), delta, name)
            elif isinstance(value, dict):
                self._delta_strings(event, (*path, name), value, depth + 1)
            elif isinstance(value, list):
                for entry in value:
                    if isinstance(entry, dict):
                        entry_index = entry.get("index")
                        before = len(event.slots)
                        entry_path = (*path, name, _key(entry_index))
                        self._delta_strings(event, entry_path, entry, depth + 1)
                        if len(event.slots) > before:
                            _integer(entry_index)

    def _responses(self, event: _Event, obj: dict[str, Any], kind: str) -> None:
        # One channel per event type across items and parts: the SDK's `output_text` joins
        # the output text of every item (one item after the other).
        part = (obj.get("output_index"), obj.get("content_index"), obj.get("summary_index"))
        if kind.endswith(".delta"):
            if isinstance(obj.get("delta"), str):
                self._in_order(("r", kind), part)
                self._slot(event, ("r", kind), obj, "delta")
        elif kind == "response.content_part.added":  # a part's text starts from the part's
            added = obj.get("part")
            if (
                isinstance(added, dict)
                and isinstance(added.get("type"), str)
                and isinstance(added.get("text"), str)
            ):
                channel = ("r", f"response.{added['type']}.delta")
                self._in_order(channel, part)
                self._slot(event, channel, added, "text")
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self._close_all()

    def _slot(self, event: _Event, key: ChannelKey, container: Any, field: str) -> None:
        value = container.get(field)
        if not isinstance(value, str):
            return
        channel = self._channels.get(key)
        if channel is None:
            if key in self._ended and value:
                # No provider sends text after the end of its channel; a stream that does
                # could split a key around the end (where the channel was flushed): refuse.
                raise HttpProtocolError(
                    "server-sent events with text after the end of its channel "
                    "(after message_stop, [DONE], a finish_reason or response.completed)",
                    status_hint=502,
                )
            if key in self._ended:  # an empty text after the end: nothing to scrub
                return
            if len(self._channels) + len(self._ended) >= MAX_CHANNELS:
                # Closing one early would let a key split around the close through: refuse.
                raise HttpProtocolError(
                    f"server-sent events with more than {MAX_CHANNELS} text channels",
                    status_hint=502,
                )
            channel = self._channels[key] = Channel(self._scrubber.stream())
        slot = Slot(container, field, value.encode("utf-8", "surrogatepass"))
        event.slots.append(slot)
        if not channel.batch:
            self._dirty.append(channel)
        channel.batch.append(slot)

    def _close(self, which: Callable[[ChannelKey], bool]) -> None:
        for key in [key for key in self._channels if which(key)]:
            self._channels.pop(key).close()
            self._ended.add(key)

    def _close_all(self, *, ended: bool = True) -> None:
        """`ended`: the stream said these texts are over (more text for them is refused);
        else they are flushed only to let the events waiting on them go (a long event)."""
        channels = self._channels
        self._channels = {}
        for key, channel in channels.items():
            channel.close()
            if ended:
                self._ended.add(key)

    # -- output ----------------------------------------------------------------------------

    def _enqueue(self, event: _Event) -> None:
        self._queue.append(event)
        self._held += len(event.raw)

    def _emit(self) -> None:
        """Feed the texts of this read to their channels, then queue for the byte scrubber
        every event at the head of the queue whose texts are decided."""
        for channel in self._dirty:
            channel.settle()
        self._dirty.clear()
        queue = self._queue
        out = self._out
        while queue and queue[0].ready():
            event = queue.popleft()
            self._held -= len(event.raw)
            out.append((event.render(), True))
