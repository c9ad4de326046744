"""Byte-exact builders of the streams real servers send (vLLM/OpenAI SSE, Ollama NDJSON)."""

from __future__ import annotations

from typing import Any

import orjson


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_chunk(content: str | None = None, finish_reason: str | None = None, *, index: int = 0,
               stop_reason: Any = None, role: bool = False, model: str = "m") -> dict[str, Any]:
    """One `chat.completion.chunk` as vLLM's OpenAI server writes it."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": model,
            "choices": [choice]}


def usage_chunk(prompt: int, completion: int, model: str = "m") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": model,
            "choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                     "completion_tokens": completion}}


def openai_stream(tokens: int, finish_reason: str = "stop", *, usage: bool = True, stop_reason: Any = None,
                  prompt: int = 7) -> list[bytes]:
    """A whole streamed chat completion: role chunk, `tokens` content chunks, finish, usage, [DONE]."""
    out = [sse(chat_chunk("", role=True))]
    out += [sse(chat_chunk(f"t{i} ")) for i in range(tokens)]
    out.append(sse(chat_chunk(None, finish_reason, stop_reason=stop_reason)))
    if usage:
        out.append(sse(usage_chunk(prompt, tokens)))
    out.append(DONE)
    return out


def openai_completion(tokens: int, finish_reason: str = "stop", prompt: int = 7) -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1733000000, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x " * tokens},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + tokens, "completion_tokens": tokens}})


def ollama_line(obj: Any) -> bytes:
    return orjson.dumps(obj) + b"\n"


def ollama_stream(tokens: int, done_reason: str = "stop", *, chat: bool = True, prompt: int = 26) -> list[bytes]:
    """Ollama's /api/chat (or /api/generate) NDJSON: one line per token, then the done line."""
    out = []
    for i in range(tokens):
        piece: dict[str, Any] = {"model": "llama3.2", "created_at": "2026-12-02T10:00:00.000000Z"}
        if chat:
            piece["message"] = {"role": "assistant", "content": f"t{i} "}
        else:
            piece["response"] = f"t{i} "
        piece["done"] = False
        out.append(ollama_line(piece))
    final: dict[str, Any] = {"model": "llama3.2", "created_at": "2026-12-02T10:00:01.000000Z"}
    if chat:
        final["message"] = {"role": "assistant", "content": ""}
    else:
        final["response"] = ""
    final.update({"done": True, "done_reason": done_reason, "total_duration": 1_500_000_000,
                  "load_duration": 100_000_000, "prompt_eval_count": prompt, "prompt_eval_duration": 200_000_000,
                  "eval_count": tokens, "eval_duration": 1_000_000_000})
    out.append(ollama_line(final))
    return out


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson"}
JSON_HEADERS = {"Content-Type": "application/json"}


# --- Anthropic Messages (the anthropic SDK's MessageStreamEvent shapes) ------------------------

def named_sse(event: str, obj: Any) -> bytes:
    """One SSE event with a name, as Anthropic's API and the servers that copy it write them."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


ANTHROPIC_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


def anthropic_stream(tokens: int, stop_reason: str = "end_turn", *, stop_sequence: str | None = None,
                     thinking: int = 0, input_tokens: int = 12, usage: bool = True,
                     tool: bool = False) -> list[bytes]:
    """A streamed message: `thinking` thinking deltas, then `tokens` text (or tool input) deltas."""
    message = {"id": "msg_01", "type": "message", "role": "assistant", "content": [], "model": "m",
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": 1}}
    out = [named_sse("message_start", {"type": "message_start", "message": message}),
           named_sse("ping", {"type": "ping"})]
    index = 0
    if thinking:
        out.append(named_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": {"type": "thinking", "thinking": ""}}))
        out += [named_sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "thinking_delta", "thinking": f"hm{i} "}})
                for i in range(thinking)]
        out.append(named_sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "signature_delta", "signature": "c2ln"}}))
        out.append(named_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    if tool:
        block = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}}
        delta = [{"type": "input_json_delta", "partial_json": f'{{"c{i}":' if i == 0 else f'"{i}"'}
                 for i in range(tokens)]
    else:
        block = {"type": "text", "text": ""}
        delta = [{"type": "text_delta", "text": f"t{i} "} for i in range(tokens)]
    out.append(named_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": block}))
    out += [named_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
            for d in delta]
    out.append(named_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    final: dict[str, Any] = {"type": "message_delta",
                             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
    if usage:
        final["usage"] = {"output_tokens": tokens + thinking}
    out.append(named_sse("message_delta", final))
    out.append(named_sse("message_stop", {"type": "message_stop"}))
    return out


def anthropic_message(tokens: int, stop_reason: str = "end_turn", *, stop_sequence: str | None = None,
                      input_tokens: int = 12) -> bytes:
    """A non-streaming Messages answer."""
    return orjson.dumps({"id": "msg_01", "type": "message", "role": "assistant", "model": "m",
                         "content": [{"type": "text", "text": "x " * tokens}], "stop_reason": stop_reason,
                         "stop_sequence": stop_sequence,
                         "usage": {"input_tokens": input_tokens, "output_tokens": tokens}})


def anthropic_error(kind: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


# --- OpenAI Responses (the openai SDK's ResponseStreamEvent shapes) ----------------------------

def _response(status: str, *, output_tokens: int | None, reasoning: int = 0, reason: str | None = None,
              tool: bool = False, max_output_tokens: int | None = 64, llamacpp: bool = False) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if tool:
        output.append({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
                       "status": "completed"})
    else:
        output.append({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": "...", "annotations": []}]})
    usage = None if output_tokens is None else {
        "input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": 9 + output_tokens}
    if llamacpp:  # llama-server's response object: no incomplete_details, error or max_output_tokens
        return {"completed_at": 1733000000, "created_at": 1733000000, "id": "resp_1", "model": "m",
                "object": "response", "output": output, "status": status, "usage": usage}
    return {"id": "resp_1", "object": "response", "created_at": 1733000000, "status": status, "model": "m",
            "output": output, "incomplete_details": None if reason is None else {"reason": reason},
            "max_output_tokens": max_output_tokens, "usage": usage, "error": None}


def responses_stream(tokens: int, status: str = "completed", *, reason: str | None = None, reasoning: int = 0,
                     usage: bool = True, terminal: str | None = None, tool: bool = False,
                     llamacpp: bool = False) -> list[bytes]:
    """A streamed response: created, `reasoning` reasoning deltas, `tokens` text deltas, the terminal event.

    `terminal` names the terminal event (default: response.completed for completed, response.incomplete
    for incomplete, response.failed for failed; vLLM sends response.completed with status incomplete).
    """
    seq = iter(range(10_000))
    created = _response("in_progress", output_tokens=None)
    created["output"] = []
    out = [named_sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                          "response": created})]
    out += [named_sse("response.reasoning_text.delta", {"type": "response.reasoning_text.delta", "item_id": "rs_1",
                                                        "output_index": 0, "content_index": 0, "delta": f"r{i} ",
                                                        "sequence_number": next(seq)})
            for i in range(reasoning)]
    kind = "response.function_call_arguments.delta" if tool else "response.output_text.delta"
    out += [named_sse(kind, {"type": kind, "item_id": "msg_1", "output_index": 0, "content_index": 0,
                             "delta": f"t{i} ", "logprobs": [], "sequence_number": next(seq)})
            for i in range(tokens)]
    final = _response(status, output_tokens=(tokens + reasoning) if usage else None, reasoning=reasoning,
                      reason=reason, tool=tool, llamacpp=llamacpp)
    if status == "failed":
        final["error"] = {"code": "server_error", "message": "the engine failed"}
    name = terminal or {"completed": "response.completed", "incomplete": "response.incomplete",
                        "failed": "response.failed"}[status]
    out.append(named_sse(name, {"type": name, "sequence_number": next(seq), "response": final}))
    return out


def responses_body(tokens: int, status: str = "completed", *, reason: str | None = None, reasoning: int = 0) -> bytes:
    """A non-streaming Responses answer: the response object."""
    return orjson.dumps(_response(status, output_tokens=tokens + reasoning, reasoning=reasoning, reason=reason))
