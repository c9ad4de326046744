"""What one response showed on the wire, accumulated chunk by chunk from its parser's events."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence

from proxy.record import MAX_IGNORED
from proxy.wire.events import AnswerText, Done, ErrorEvent, Event, Finish, ParseError, ServerTimings, TokenDelta, Usage
from proxy.wire.fast_tokens import EVENTS, VISIBLE
from proxy.wire.parsers import Read, ResponseParser

_ONE_TOKEN = EVENTS[VISIBLE]  # the parsers' answer for a read of one plain token, always this list
ITL_SAMPLES_CAP = 65_536  # gaps kept per response for the percentiles; beyond, only mean and max
# A stream's reads are parsed in runs of this many (or bytes), not one by one as they pass: at one
# event per read a server's reads come tens of milliseconds apart, and each parse alone runs cold
# (its code and data out of the CPU's caches). In a run they cost a third; runs of 64 reads cost
# about 5 % less per event than runs of 16 at one event per read (`benchmarks/overhead.py`, 64
# paced streams). Nothing reads the tally before the body ends (`close_steps` parses what is left), and
# every read keeps its own arrival time, so the record is the one a read-by-read parse makes. What
# a stream holds unparsed is bounded by RUN_BYTES (a run of 64 one-token events is about 13 KiB).
RUN_READS = 64
RUN_BYTES = 16 * 1024
# What is left when the body ends is parsed in steps of this many reads (`close_steps`), the loop's
# other work between them: a whole run parsed in one go holds the relay's reads back for its length.
STEP_READS = 16


class StreamTally:
    """Token timing, the final events, and parse failures of one response body.

    `tokens` counts every generated piece the wire showed (visible and reasoning alike, at least
    one token each); `reasoning` the part of it that was thinking. Inter-token latency is
    measured between arrivals of chunks that carry tokens, at the proxy: several tokens in one
    chunk count as tokens, not as zero-length gaps.
    """

    __slots__ = (
        "bytes_out", "closed", "done", "error", "finish", "first_token_at", "gap_count", "gap_max", "gap_sum", "gaps",
        "last_token_at", "parse_error", "parse_errors", "parser", "pending", "pending_bytes", "reasoning", "runs",
        "texts", "timings", "tokens", "usage",
    )

    def __init__(self, parser: ResponseParser | None) -> None:
        self.parser = parser
        self.runs = parser is not None and parser.streaming  # reads parsed in runs (RUN_READS)
        self.pending: list[Read] = []  # reads not parsed yet, with their arrival times
        self.pending_bytes = 0
        self.bytes_out = 0
        self.tokens = 0
        self.reasoning = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps = array("d")
        self.gap_sum = 0.0
        self.gap_count = 0
        self.gap_max = 0.0
        self.finish: Finish | None = None
        self.usage: Usage | None = None
        self.timings: ServerTimings | None = None
        self.error: ErrorEvent | None = None
        self.done = False
        self.closed = False
        self.texts: AnswerTexts | None = None  # the answer's structured text, where the request asked for structure
        self.parse_errors = 0
        self.parse_error: str | None = None

    @property
    def streaming(self) -> bool:
        """The body is a stream of events (SSE, NDJSON), not one JSON document."""
        return self.parser is not None and self.parser.streaming

    def feed(self, chunk: bytes, now: float) -> None:
        """Account for one chunk that was forwarded (parsed now, or with the next run); never raises."""
        size = len(chunk)
        self.bytes_out += size
        if self.runs:
            pending = self.pending
            pending.append((chunk, 0, size, now))
            self.pending_bytes += size
            if len(pending) >= RUN_READS or self.pending_bytes >= RUN_BYTES:
                self._parse_pending()
            return
        self._parse(chunk, now)

    def feed_reads(self, reads: list[Read], size: int) -> None:
        """`feed` for each of `reads` in order, their payloads `size` bytes in all, each left in its
        read (the relay's lane keeps a chunk's framing around it): no copy of each is made. The tally
        keeps the list."""
        self.bytes_out += size
        if not self.runs:
            for data, start, end, now in reads:
                self._parse(data[start:end], now)
            return
        if self.pending:
            self.pending += reads
        else:
            self.pending = reads
        self.pending_bytes += size
        if len(self.pending) >= RUN_READS or self.pending_bytes >= RUN_BYTES:
            self._parse_pending()

    def _parse_pending(self, most: int | None = None) -> None:
        """The run's reads in order (its first `most` only, when given: the rest stay pending, and
        `pending_bytes` still counts the whole run until the last of it is parsed: an over-count,
        never an under-count, and only after the body ended): those the parser finds to be one
        plain token each are counted in one loop, the others parsed one by one."""
        pending = self.pending
        if most is not None and len(pending) > most:
            self.pending = pending[most:]
            pending = pending[:most]
        else:
            self.pending, self.pending_bytes = [], 0
        at, end = 0, len(pending)
        while at < end:
            parser = self.parser
            plain = parser.plain_reads(pending, at) if parser is not None else 0
            if plain:
                self.tokens += plain
                self._arrivals(pending, at, at + plain)
                at += plain
            else:
                data, begin, stop, now = pending[at]
                self._parse(data if begin == 0 and stop == len(data) else data[begin:stop], now)
                at += 1

    def _parse(self, chunk: bytes, now: float) -> None:
        parser = self.parser
        if parser is None:
            return
        try:
            events = parser.feed(chunk)
        except Exception as exc:  # a parser bug must not touch the traffic
            self._parser_failed(exc)
            return
        if events is _ONE_TOKEN:  # the usual read, as _apply would take it
            self.tokens += 1
            self.tokens_arrived(now)
        elif events:
            self._apply(events, now)

    def close_steps(self, now: float) -> Iterator[None]:
        """The body ended at `now`: what is left is parsed (idempotent), in steps of STEP_READS
        reads, yielding between two (nothing is fed meanwhile: the body has ended)."""
        if self.closed:
            return
        self.closed = True
        while len(self.pending) > STEP_READS:
            self._parse_pending(STEP_READS)
            yield
        if self.pending:
            self._parse_pending()
        parser = self.parser
        if parser is None:
            return
        try:
            events = parser.close()
        except Exception as exc:
            self._parser_failed(exc)
            return
        if events:
            self._apply(events, now)

    def _parser_failed(self, exc: Exception) -> None:
        self.parser = None
        self.parse_errors += 1
        self.parse_error = f"parser failed: {type(exc).__name__}: {exc}"[:300]

    def _apply(self, events: Sequence[Event], now: float) -> None:
        tokens_before = self.tokens
        for event in events:
            if isinstance(event, TokenDelta):
                self.tokens += event.count
                if event.reasoning:
                    self.reasoning += event.count
            elif isinstance(event, Finish):
                if self.finish is None or (event.choice == 0 and self.finish.choice != 0):
                    self.finish = event
            elif isinstance(event, Usage):
                old = self.usage  # a later report fills in, never erases, what an earlier one said
                self.usage = event if old is None else Usage(
                    old.prompt_tokens if event.prompt_tokens is None else event.prompt_tokens,
                    old.completion_tokens if event.completion_tokens is None else event.completion_tokens,
                    old.reasoning_tokens if event.reasoning_tokens is None else event.reasoning_tokens,
                    (old.ignored + event.ignored)[:MAX_IGNORED])
            elif isinstance(event, Done):
                self.done = True
            elif isinstance(event, ErrorEvent):
                if self.error is None:
                    self.error = event
            elif isinstance(event, ServerTimings):
                self.timings = event
            elif isinstance(event, AnswerText):
                if self.texts is not None:
                    self.texts.add(event)
            elif isinstance(event, ParseError):
                self.parse_errors += 1
                if self.parse_error is None:
                    self.parse_error = event.message
        if self.tokens != tokens_before:
            self.tokens_arrived(now)

    def tokens_arrived(self, now: float) -> None:
        """Note the arrival time of a chunk that carried tokens (TTFT and the inter-token gaps)."""
        last = self.last_token_at
        if last is None:
            self.first_token_at = now
        else:
            gap = now - last
            self.gap_sum += gap
            self.gap_count += 1
            if gap > self.gap_max:
                self.gap_max = gap
            if len(self.gaps) < ITL_SAMPLES_CAP:
                self.gaps.append(gap)
        self.last_token_at = now

    def _arrivals(self, reads: list[Read], start: int, end: int) -> None:
        """`tokens_arrived` for each of reads[start:end], in one loop."""
        last = self.last_token_at
        if last is None:
            last = self.first_token_at = reads[start][3]
            start += 1
        gaps, room = self.gaps, ITL_SAMPLES_CAP - len(self.gaps)
        total, top = self.gap_sum, self.gap_max
        for _, _, _, now in reads[start:end]:
            gap = now - last
            total += gap
            if gap > top:
                top = gap
            if room > 0:
                gaps.append(gap)
                room -= 1
            last = now
        self.gap_count += end - start
        self.gap_sum, self.gap_max, self.last_token_at = total, top, last

    def itl_stats(self) -> tuple[float | None, float | None, float | None]:
        """(mean, p95, max) of the gaps between token chunks, or Nones with fewer than two."""
        if not self.gap_count:
            return None, None, None
        ordered = sorted(self.gaps)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return self.gap_sum / self.gap_count, p95, self.gap_max


TEXT_MAX_BYTES = 256 * 1024  # the structured text one answer keeps to check it, at most
TOOL_CALLS_MAX = 64  # tool calls one answer keeps, at most


class AnswerTexts:
    """The text of an answer's structured parts, kept (bounded) to check that each is whole JSON at
    its end: the visible content, and each tool call's arguments, by key. Never logged or stored.

    Past `cap` bytes (or TOOL_CALLS_MAX calls), or when the process-wide bytes held for parsing run
    out (`reserve`), it stops keeping and says so (`overflow`): the check then cannot be made."""

    __slots__ = ("_release", "_reserve", "cap", "content", "held", "overflow", "tool_calls")

    def __init__(self, cap: int = TEXT_MAX_BYTES, reserve: Callable[[int], bool] = lambda size: True,
                 release: Callable[[int], None] = lambda size: None) -> None:
        self.cap = cap
        self._reserve, self._release = reserve, release
        self.content: dict[str, list[str]] = {}
        self.tool_calls: dict[str, list[str]] = {}
        self.held = 0  # bytes kept
        self.overflow: str | None = None

    def add(self, text: AnswerText) -> None:
        if self.overflow is not None:
            return
        size = len(text.text)
        if self.held + size > self.cap:
            self.overflow = f"the answer's structured text passed the {self.cap // 1024} KiB kept to check it"
        elif not self._reserve(size):
            self.overflow = "the process-wide bytes held for parsing (--parse-bytes) ran out"
        if self.overflow is not None:
            self.drop()
            return
        self.held += size
        if text.part == "content":
            self.content.setdefault(text.key, []).append(text.text)
            return
        key = text.key or f"whole:{len(self.tool_calls)}"
        if key not in self.tool_calls and len(self.tool_calls) >= TOOL_CALLS_MAX:
            self.overflow = f"more than {TOOL_CALLS_MAX} tool calls"
            self.drop()
            return
        self.tool_calls.setdefault(key, []).append(text.text)

    def drop(self) -> None:
        """Let go of the text (the check is done, or cannot be made)."""
        self.content.clear()
        self.tool_calls.clear()
        self._release(self.held)
        self.held = 0
