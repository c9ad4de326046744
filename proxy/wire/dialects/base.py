"""What a wire dialect is: its routes, what it reads from a request, and the events in its responses.

A dialect module holds one wire format whole and ends with one `Dialect` value; the registry
(`proxy.wire.dialects`) maps routes to them. Everything here is pure: JSON objects in, typed values out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.record import INT64_MAX, INT64_MIN, MAX_COUNT, RequestInfo, utf8_text
from proxy.wire.events import ErrorEvent, Event


@dataclass(frozen=True, slots=True)
class Dialect:
    """One wire format, as the proxy reads it.

    - `routes`: the request paths it serves (a path is matched exactly, without a trailing /);
    - `read_request`: fills what the client asked for from the request's JSON object;
    - `events`: the events in one JSON object of its responses (a streamed event, an NDJSON
      line, or a whole non-streaming body); it may raise ValueError/TypeError on a shape it
      cannot read, which the parser turns into a ParseError;
    - `token_keys`, `reasoning_keys`: the fast path (proxy/wire/fast_tokens.py). The JSON keys, with their
      value's opening quote (`b'"content":"'`), whose string is the text of a streamed event that
      `events` reads as one visible (or reasoning) token; the shape of such an event is learned
      (and kept for the dialect's next responses) and later events in that shape are counted
      without decoding: `events` must be pure, the same JSON giving the same events;
    - `streams_by_default`: what `stream` means when the request leaves it out;
    - `provider`: the provider OpenTelemetry's GenAI conventions name for it (`gen_ai.provider.name`);
    - `sweep_dialect`: the dialect a sweep repeats its requests in (llama.cpp's `/completion` is swept
      through its OpenAI route);
    - `texts`: the text of an answer's structured parts in one JSON object (`AnswerText`: the visible
      content, each tool call's arguments), read only for a request that asked for structure.
    """

    name: str
    routes: tuple[str, ...]
    read_request: Callable[[dict[str, Any], RequestInfo], None]
    events: Callable[[Any], list[Event]]
    token_keys: tuple[bytes, ...] = ()
    reasoning_keys: tuple[bytes, ...] = ()
    streams_by_default: bool = False
    provider: str = ""  # (empty: the dialect's own name)
    sweep_dialect: str = ""  # (empty: the dialect's own name)
    texts: Callable[[Any], list[Event]] = lambda obj: []  # an answer's structured text (`AnswerText`), on demand


# The integers a record may hold whichever parser read them: orjson (a body under its size) turns
# integers past 64 bits into floats, the standard library's parser (a bigger body) keeps any integer,
# and SQLite, PostgreSQL (BIGINT) and OTLP take signed 64-bit ones. One client's `"seed": 1e40` written
# as digits must not become a record that no JSON, log line or database can take.
INT_MIN, INT_MAX = INT64_MIN, INT64_MAX


def as_int(value: Any) -> int | None:
    """A JSON integer (not a bool) that orjson keeps as one, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and INT_MIN <= value <= INT_MAX:
        return value
    return None


def as_number(value: Any) -> float | None:
    """A finite JSON number (not a bool), else None (the standard library's parser reads `NaN`,
    `Infinity` and integers past any float)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) and not isinstance(value, bool) and INT_MIN <= value <= INT_MAX:
        return float(value)
    return None


def as_count(value: Any) -> int | None:
    """A count a server or a client states (tokens, a context, a choice number): a whole number from 0
    to MAX_COUNT; anything else is not said (`out_of_range` names it for the record's note)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def out_of_range(obj: dict[str, Any], *names: str) -> tuple[str, ...]:
    """`name=value` for each of `names` that `obj` holds as a number but no count can be (negative, or
    past MAX_COUNT): left out of the record, and said there (`values_ignored`)."""
    return tuple(f"{name}={str(obj[name])[:24]}" for name in names
                 if isinstance(obj.get(name), int | float) and not isinstance(obj.get(name), bool)
                 and as_count(obj[name]) is None)


def positive_count(obj: dict[str, Any], name: str, info: RequestInfo, *, allowed: tuple[int, ...] = ()) -> int | None:
    """A positive count a request asks for (`num_ctx`, `n`), or one of its `allowed` special values
    (llama.cpp's `n_keep` -1: keep the whole prompt); 0 or absent is none, anything else is left out and
    noted in `info.ignored`."""
    value = obj.get(name)
    if value is None or value == 0:
        return None
    number = as_int(value)
    if number is not None and (number in allowed or 0 < number <= MAX_COUNT):
        return number
    info.ignored.append(f"{name}={str(value)[:24]}")
    return None


def positive_budget(value: Any) -> int | None:
    """A budget in tokens; 0 or less (Ollama's -1 infinite, -2 fill context) means none fixed."""
    number = as_int(value)
    return number if number is not None and 0 < number <= MAX_COUNT else None


def error_event(error: Any, *, overloaded_types: frozenset[str] = frozenset()) -> ErrorEvent:
    """An `error` member, as an object (`message`, `type`/`code`) or a plain string."""
    if isinstance(error, dict):
        message = error.get("message")
        kind = error.get("type") or error.get("code")
        kind_text = None if kind is None else str(kind)
        return ErrorEvent(str(message if message is not None else error)[:500], kind_text,
                          overloaded=kind_text in overloaded_types)
    return ErrorEvent(str(error)[:500])


def expect_object(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


def read_common(obj: dict[str, Any], info: RequestInfo, *, budget_fields: tuple[str, ...]) -> None:
    """Model, sampling and the first budget field present: what most dialects read alike."""
    model = obj.get("model")
    info.model = utf8_text(model[:200]) if isinstance(model, str) else None
    for name in budget_fields:
        if obj.get(name) is not None:
            info.requested_max_tokens = positive_budget(obj.get(name))
            break
    info.seed = as_int(obj.get("seed"))
    info.temperature = as_number(obj.get("temperature"))
    info.tools = bool(obj.get("tools"))
    info.json_format = asks_for_json(obj)


def asks_for_json(obj: dict[str, Any]) -> bool:
    """The request constrains its answer to JSON: OpenAI's `response_format` (`json_object`,
    `json_schema`), the Responses API's `text.format`, vLLM's `guided_json` and
    `structured_outputs.json`, llama.cpp's `json_schema`, Ollama's `format` (`json` or a schema)."""
    formats = [obj.get("response_format")]
    text = obj.get("text")
    if isinstance(text, dict):
        formats.append(text.get("format"))
    if any(isinstance(f, dict) and f.get("type") in ("json_object", "json_schema") for f in formats):
        return True
    structured = obj.get("structured_outputs")
    if isinstance(structured, dict) and structured.get("json") is not None:
        return True
    given = obj.get("format")
    return (obj.get("guided_json") is not None or isinstance(obj.get("json_schema"), dict)
            or given == "json" or isinstance(given, dict))


# Roles whose text a chat template renders as the client sent it. A system message is left out: some
# templates fold it elsewhere or drop it, and an assistant turn may lose its thinking on the way in.
_VERBATIM_ROLES = frozenset({"user", "tool"})


# Content parts whose `text` the servers render into the prompt: OpenAI's and Anthropic's `text`, the
# Responses API's `input_text` (vLLM's chat_utils parses these; Ollama's OpenAI layer reads `text` only,
# openai/openai.go fromChatRequest). A `text` in any other part (an image_url's) is never read: its words
# bound nothing.
TEXT_PARTS = frozenset({"text", "input_text"})


def text_words(content: Any) -> int:
    """Whitespace-separated words in a message's content: a string, or a list of parts, counting the
    `text` of the parts the server reads as text (`TEXT_PARTS`) and a tool result's content."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        words = 0
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            text = part.get("text")
            if kind in TEXT_PARTS and isinstance(text, str):
                words += len(text.split())
            elif kind == "tool_result":
                words += text_words(part.get("content"))
        return words
    return 0


def text_size(content: Any) -> tuple[int, int] | None:
    """(words, UTF-8 bytes) of a message's text: a string, or a list of text parts; None when it
    holds a part the proxy cannot size (an image: its tokens are not its bytes)."""
    if isinstance(content, str):
        return len(content.split()), len(content.encode("utf-8", "surrogatepass"))
    if content is None:
        return 0, 0
    if not isinstance(content, list):
        return None
    words = size = 0
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            return None
        words += len(part["text"].split())
        size += len(part["text"].encode("utf-8", "surrogatepass"))
    return words, size


# A message's fields whose text a template renders as it is, beside its content (Ollama's api.Message).
_RENDERED_TEXT = ("content", "thinking")


def read_messages(messages: Any, info: RequestInfo) -> None:
    """What a chat's messages say of its prompt: whether there is one, whether a user speaks in it,
    the words of the user's (and tools') turns, and the words and bytes of every message.

    The words are a lower bound on the prompt's tokens: a tokenizer never merges two words across
    the whitespace between them (GPT-2-style pre-tokenizers split there, SentencePiece splits by
    whitespace), so each word costs at least one token, and a template renders these turns whole.
    The bytes of every message are the text of an upper bound (a token is at least one byte); a
    message with an image or a tool call, whose tokens are not its text's, leaves them unknown.
    """
    if not isinstance(messages, list) or not messages:
        return
    info.has_prompt = True
    words = 0
    user = False
    all_words = 0
    all_bytes: int | None = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        info.messages += 1
        role = message.get("role")
        if role == "user":
            user = True
        if role in _VERBATIM_ROLES:
            words += text_words(message.get("content"))
        for name in _RENDERED_TEXT:
            size = text_size(message.get(name))
            if size is None:
                all_bytes = None
                all_words += text_words(message.get(name))
                continue
            all_words += size[0]
            if all_bytes is not None:
                all_bytes += size[1]
        if message.get("images") or message.get("tool_calls"):
            all_bytes = None
    info.user_turn = user
    info.prompt_words = words
    info.all_words = all_words
    info.all_bytes = all_bytes


def read_prompt_text(prompt: Any, info: RequestInfo) -> None:
    """A completion's `prompt`: one string (its words bound its tokens from below), or something the
    proxy does not count (a batch of prompts, token ids)."""
    if isinstance(prompt, str):
        info.has_prompt = bool(prompt)
        info.prompt_words = info.all_words = len(prompt.split())
        info.all_bytes = len(prompt.encode("utf-8", "surrogatepass"))
        info.messages = 1
    elif isinstance(prompt, list) and prompt:
        info.has_prompt = True


def read_chat_or_prompt(obj: dict[str, Any], info: RequestInfo) -> None:
    """A body that is a chat (`messages`) or a completion (`prompt`), whichever it holds."""
    info.tools = bool(obj.get("tools"))
    info.json_format = asks_for_json(obj)
    if "messages" in obj:
        read_messages(obj.get("messages"), info)
    else:
        read_prompt_text(obj.get("prompt"), info)
