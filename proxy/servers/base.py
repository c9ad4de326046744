"""What every server module says, and the words they share.

A server module (`vllm`, `llamacpp`, `ollama`, `sglang`) holds one server kind whole, as a dialect
module holds one wire format:
- how the server is recognized from its own answers, and the context one request gets (`identify`);
- its tokenizer call, which counts a request's prompt as the server builds it (`count_prompt`);
- its rules: whether it cuts a prompt it was sent (`prompt_truncation`), and how it sizes a request's
  budget (`length_cause`), each with a link to the server's source that shows it;
- the names of its Prometheus metrics (`metric_names`), and how its own state is read.

`Server` itself is what the proxy knows of a server it does not recognize: nothing it could rest a
conclusion on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from proxy.record import LengthCause, RequestInfo, ResponseRecord
from proxy.wire.dialects.base import as_count

ServerKind = Literal["llamacpp", "vllm", "sglang", "ollama", "unknown"]
TelemetryRead = Literal["metrics_text", "loaded_models"]  # a Prometheus page, or a list of loaded models

# When the server's tokenizer was given the prompt without every field that shapes it (a tool
# choice, a response format), its count may differ from the prompt the server built by a few
# tokens: a budget this close to the context is not decided.
APPROXIMATE_SLACK = 64


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The context the server says one request gets, and how many slots share it, where it says."""

    source: str  # e.g. "llama.cpp GET /props"
    context_per_request: int | None
    slots: int | None = None
    # What the server renders around the messages, where it says (Ollama's `/api/show`): the
    # template's bytes and the model's own system prompt's, for an upper bound on a prompt's tokens.
    template_bytes: int | None = None
    system_bytes: int | None = None

    def describe(self) -> str:
        """`1,024 tokens per request over 4 slots (llama.cpp GET /props)`."""
        parts = []
        if self.context_per_request is not None:
            parts.append(f"{self.context_per_request:,} tokens per request")
        if self.slots is not None:
            parts.append(f"{self.slots} slot{'s' if self.slots != 1 else ''}")
        return f"{', '.join(parts) or 'nothing about its context'} ({self.source})"

    def split_hint(self) -> str | None:
        """With several slots: what one context split between them would be (the server does not say)."""
        if self.context_per_request is None or not self.slots or self.slots < 2:
            return None
        whole = self.context_per_request * self.slots
        return f"{whole:,} split over {self.slots} slots = {self.context_per_request:,} each?"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """Which server answers, and what it says of each model's context: what the proxy knows of its
    upstream between responses (kept fresh by `proxy.servers.identity.IdentityPoller`)."""

    kind: ServerKind
    default: ServerInfo | None = None  # the context when a request names no model the server lists
    by_model: Mapping[str, ServerInfo] = field(default_factory=dict)
    router: bool = False  # llama.cpp's router mode: every state read needs ?model=
    version: str | None = None  # where the server says it (Ollama's /api/version)

    def info_for(self, model: str | None) -> ServerInfo | None:
        """What the server says of `model`'s context (its only model's, when it names one)."""
        if model is not None and model in self.by_model:
            return self.by_model[model]
        if self.default is not None:
            return self.default
        if len(self.by_model) == 1 and not self.router:
            return next(iter(self.by_model.values()))
        return None

    def context_for(self, model: str | None) -> int | None:
        info = self.info_for(model)
        return info.context_per_request if info is not None else None

    def to_dict(self) -> dict[str, Any]:
        """As the admin API's `/api/about` says it (`identity_from_dict` reads it back)."""
        return {"kind": self.kind, "router": self.router, "version": self.version,
                "default": self.default.to_dict() if self.default is not None else None,
                "models": {name: info.to_dict() for name, info in self.by_model.items()}}


UNKNOWN_SERVER = ServerIdentity("unknown")


def positive_count(value: Any) -> int | None:
    """A context or a number of slots: a positive count; a negative or absurd one is not said."""
    number = as_count(value)
    return number if number is not None and number > 0 else None


def info_from_dict(value: Any) -> ServerInfo | None:
    if not isinstance(value, dict) or not isinstance(value.get("source"), str):
        return None
    return ServerInfo(value["source"][:80], positive_count(value.get("context_per_request")),
                      positive_count(value.get("slots")), as_count(value.get("template_bytes")),
                      as_count(value.get("system_bytes")))


def contexts_text(identity: ServerIdentity) -> dict[str, int | None]:
    """Each model's context, for a log line."""
    shown = {name: info.context_per_request for name, info in identity.by_model.items()}
    if identity.default is not None:
        shown["*"] = identity.default.context_per_request
    return shown


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Where one server family keeps the figures the proxy reads from its `/metrics`; the first
    name present wins."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_cache_usage: tuple[str, ...]
    preemptions: tuple[str, ...]
    request_preemptions: tuple[str, ...] = ()  # a per-request histogram's sum: preemptions of finished requests
    requests_finished: tuple[str, ...] = ()  # and its count: the requests finished


@dataclass(frozen=True, slots=True)
class SpanNames:
    """How a server names its own request span and its attributes (`proxy.servers.traces`)."""

    span: str
    request_id: str  # the attribute with the server's request id
    id_prefixes: tuple[str, ...]  # what the server puts before the X-Request-Id it was sent
    counts: dict[str, str]  # attribute -> ServerSpan field, token counts
    seconds: dict[str, str]  # attribute -> ServerSpan field, durations in seconds


@dataclass(frozen=True, slots=True)
class PromptFinding:
    """Whether the server cut the prompt (None: cannot know), and how that was decided."""

    truncated: bool | None
    detail: str | None


NOT_ASKED = PromptFinding(None, None)


@dataclass(frozen=True, slots=True)
class PromptCount:
    """The prompt as the server's own tokenizer counted it, and the context it says a request gets."""

    tokens: int
    context: int | None
    source: str  # e.g. "vLLM POST /tokenize"
    exact: bool = True  # False: the tokenizer could not be given every field that shapes the prompt


@dataclass(frozen=True, slots=True)
class TokenizerQuery:
    """A finished record's request, for the server's tokenizer to count its prompt: the request body
    as the client sent it (the prompt's text never leaves the proxy's memory but to that server)."""

    dialect: str
    route: str
    model: str | None
    body: bytes
    requested_max_tokens: int
    truncate_prompt_tokens: int | None


class TokenizerUnavailable(Exception):
    """The server's tokenizer could not count the prompt; the message says why, in a few words."""

    def __init__(self, reason: str, result: str = "failed") -> None:
        super().__init__(reason)
        self.result = result  # for the metric: unavailable | failed | timeout


class ServerAnswers(Protocol):
    """What a server module asks its server through (`proxy.servers.answers.ServerAnswers`)."""

    async def get_json(self, path: str) -> Any:
        """The JSON of `GET path`, or None when there is none to read."""
        ...

    async def post_json(self, path: str, payload: dict[str, Any] | bytes, headers: dict[str, str]) -> Any:
        """The JSON answer of `POST path` (TokenizerUnavailable when there is none)."""
        ...


class Server:
    """A server kind. This base is the server the proxy does not know: it recognizes nothing, has no
    tokenizer to ask, and no rule of its own to conclude from."""

    kind: ServerKind = "unknown"
    name = "an unrecognized server"
    native_dialects: tuple[str, ...] = ()  # routes only this server serves: they name it before it answers
    metric_names: MetricNames | None = None
    telemetry_read: TelemetryRead | None = None  # how `--upstream-metrics KIND` reads its state

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        """Which server this is, from its answers (None: not this kind)."""
        return None

    def concurrency_switch(self, limit: int) -> str | None:
        """The server's own setting that runs at most `limit` requests at once (None: it has none)."""
        return None

    async def context_for(self, answers: ServerAnswers, model: str) -> ServerInfo | None:
        """The context `model` gets, where this kind of server says it."""
        found = await self.identify(answers, (model,))
        return found.info_for(model) if found is not None else None

    def asks_about(self, model: str, identity: ServerIdentity) -> bool:
        """Whether a model named in a request, not known yet, is worth asking the server about now."""
        return identity.router

    async def count_prompt(self, answers: ServerAnswers, query: TokenizerQuery, request: dict[str, Any],
                           identity: ServerIdentity, headers: dict[str, str]) -> PromptCount:
        """The prompt's count by the server's own tokenizer; TokenizerUnavailable otherwise."""
        raise TokenizerUnavailable(f"no tokenizer is known for this server ({self.kind})", "unavailable")

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        """Did this server cut the answer's prompt? (An answered generation only.)"""
        return PromptFinding(None, "the server is not one whose prompt counts the proxy knows how to read")

    def length_cause(self, prompt: int, requested: int, context: int, said: str) -> tuple[LengthCause, str]:
        """A length stop's cause by this server's budget rule, from the prompt's count, the budget
        asked and the context a request gets (`said`: those numbers in words)."""
        return "unknown", f"no budget rule is known for this server ({self.kind})"


def context_of(record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> int | None:
    """The context one request gets: the request's own `num_ctx` (Ollama), else the server's word."""
    if info.num_ctx:
        return info.num_ctx
    return identity.context_for(record.model)


# Around the messages' own bytes, a prompt holds the template's text (rendered at most once per message
# and twice more: its head and its tail), the model's own system prompt, and the tokens a tokenizer
# adds that are no text (a BOS, an EOS).
TEMPLATE_RENDERS_BEYOND_MESSAGES = 2
TOKENS_NOT_TEXT = 2


def prompt_bounds(record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> tuple[int | None, int | None]:
    """(at least, at most) the prompt's tokens before any cut, where the request says them.

    At least its words: every message's text is rendered, and each word is at least one token. At
    most its bytes: a token is at least one byte of the rendered text, which is the messages' bytes,
    the template's text and the model's own system prompt, where the server says them (Ollama's
    `/api/show`); unknown with tools (their definitions are rendered in a form the proxy does not
    size), an image, or a template the server does not show."""
    lower = info.all_words if info.all_words is not None else info.prompt_words  # (the user's turns: a part)
    server = identity.info_for(record.model)
    upper = None
    if (info.all_bytes is not None and not info.tools and server is not None and server.template_bytes is not None):
        upper = (info.all_bytes + (server.system_bytes or 0) + TOKENS_NOT_TEXT
                 + (info.messages + TEMPLATE_RENDERS_BEYOND_MESSAGES) * server.template_bytes)
    return lower, upper


def silent_cut(record: ResponseRecord, info: RequestInfo, identity: ServerIdentity, name: str,
               how: str) -> PromptFinding:
    """For a server that cuts a prompt silently and reports its count after the cut (`name` says
    which, `how` when it cuts): decided by sound bounds, never by a guess.

    - A count below the prompt's lower bound proves a cut; so does a lower bound above the context
      the request gets (the server answered, so it cut).
    - An upper bound within the context proves there was none.
    - Between them it stays open, with both bounds said."""
    counted = record.prompt_tokens if record.prompt_tokens_source == "usage" else None
    lower, upper = prompt_bounds(record, info, identity)
    context = context_of(record, info, identity)
    within = f" (context {context:,} tokens)" if context else ""
    if counted is not None and lower is not None and counted < lower:
        return PromptFinding(True, f"{name} evaluated {counted:,} prompt tokens{within}, while the messages hold "
                                   f"{lower:,} words, each at least one token: it cut the prompt")
    if lower is not None and context and lower > context:
        return PromptFinding(True, f"the messages hold {lower:,} words, each at least one token, more than the "
                                   f"{context:,} tokens a request gets, and {name} answered: it cut the prompt")
    if upper is not None and context and upper <= context:
        return PromptFinding(False, f"the prompt is at most {upper:,} tokens (its {info.all_bytes:,} bytes, the "
                                    "model's template and system prompt as the server shows them, a token at least "
                                    f"a byte), within the {context:,} tokens a request gets: nothing was cut")
    said = [f"at least {lower:,} tokens (its words)" if lower is not None else "no lower bound",
            f"at most {upper:,} (its bytes, template and system prompt)" if upper is not None
            else "no upper bound (tools, an image, or a template the server does not show)",
            f"the context {context:,}" if context else "no context known"]
    said.append(f"{name} counted {counted:,}" if counted is not None else f"{name} reported no prompt count")
    return PromptFinding(None, f"{how}; the prompt is between the bounds: " + ", ".join(said))
