"""A fake Ollama that cuts prompts, thinks and loads the way the real one does, for the tests.

Built from Ollama's source (github.com/ollama/ollama, 2026-08):
- `server/prompt.go`, chatPrompt: with `truncate` (the default) the messages are rendered and
  tokenized, and the oldest non-system messages are dropped until the prompt fits `NumCtx`; the
  last message always stays. `prompt_eval_count` then counts the prompt that was kept
  (llm/llama_server.go: cache_n + prompt_n since 0.30.1). No field says anything was dropped.
- `server/routes.go`, ChatHandler: a chat with no messages answers `done_reason: "load"` with empty
  content; Ollama's cloud models answer a chat with no user turn the same way (oh-my-pi#7465).
  A thinking model thinks by default (`req.Think` nil -> true): the thinking streams in
  `message.thinking` and is spent from `num_predict` like the answer; a budget spent thinking
  ends `done_reason: "length"` with `content: ""`.
- `openai/openai.go`: `/v1/chat/completions` streams `delta.reasoning` and `delta.content`,
  `finish_reason` from done_reason, `usage.prompt_tokens` = prompt_eval_count.
- `GET /api/version` answers `{"version"}`; `GET /api/ps` lists the loaded model with its
  `context_length`; `POST /api/show` its `template` and `system` (api/types.go, ShowResponse; a
  model with a built-in `renderer` shows no template).

Its tokenizer is one token per whitespace-separated word, plus one per message header: enough to
make the proxy's lower bound (a word is at least one token) meet a real count. `split` gives each
request `context // in flight` tokens, the way a context shared between parallel requests shrinks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp

VERSION = "0.33.2"
MODEL = "qwen3:4b"
# A ChatML template in Ollama's Go template syntax, as `ollama show --template` prints one.
TEMPLATE = ("{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
            "{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 -}}"
            "<|im_start|>{{ .Role }}\n{{ .Content }}{{ if not $last }}<|im_end|>\n{{ end }}"
            "{{- if and $last (ne .Role \"assistant\") }}<|im_end|>\n<|im_start|>assistant\n{{ end }}{{- end }}")


@dataclass
class FakeOllama(LoopbackApp):
    context: int = 4096  # tokens a request gets (what /api/ps says), unless options.num_ctx says less
    split: bool = False  # share the context between requests in flight
    thinking: int = 0  # thinking tokens before each answer (a thinking model), 0 for none
    answer: int = 12  # answer tokens after the thinking, then EOS
    token_delay_s: float = 0.001
    in_flight: int = 0
    prompts: list[int] = field(default_factory=list)  # prompt_eval_count of each chat answered
    template: str | None = TEMPLATE  # what /api/show says (None: a built-in renderer, no template shown)
    loaded: bool = True  # /api/ps lists the model
    unload_mid_answer: bool = False  # an answer's model is unloaded halfway, and its stream broken (#8398)
    server: TestServer | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/version", self._version)
        app.router.add_get("/api/ps", self._ps)
        app.router.add_post("/api/show", self._show)
        app.router.add_post("/api/chat", self._chat)
        app.router.add_post("/v1/chat/completions", self._openai_chat)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def _ps(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return web.json_response({"models": []})
        return web.json_response({"models": [{
            "name": MODEL, "model": MODEL, "size": 3_000_000_000, "size_vram": 3_000_000_000,
            "digest": "sha256:0", "details": {}, "expires_at": "2026-12-05T00:00:00Z",
            "context_length": self.context}]})

    async def _show(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if body.get("model") != MODEL:
            return web.json_response({"error": f"model '{body.get('model')}' not found"}, status=404)
        shown: dict[str, Any] = {"modelfile": "FROM qwen3", "parameters": "", "details": {"format": "gguf"},
                                 "model_info": {"general.architecture": "qwen3"}, "capabilities": ["completion"]}
        if self.template is None:
            shown["renderer"] = "qwen3"
        else:
            shown["template"] = self.template
        return web.json_response(shown)

    # --- what Ollama does with a chat -----------------------------------------------------------
    def _granted(self, options: dict[str, Any]) -> int:
        granted = min(int(options.get("num_ctx") or self.context), self.context)
        return max(1, granted // max(1, self.in_flight)) if self.split else granted

    @staticmethod
    def _tokens(messages: list[dict[str, Any]]) -> int:
        """The rendered prompt's length: a header token per message, a word per token, the
        assistant header the template ends with."""
        return sum(1 + len(str(m.get("content") or "").split()) for m in messages) + 1

    def _kept(self, messages: list[dict[str, Any]], num_ctx: int) -> int:
        """chatPrompt: drop the oldest messages (system ones stay) until the prompt fits; the last
        message always stays. A prompt still too long is then cut in the runner, keeping num_keep
        (4) tokens and the tail (llm/llama_server.go, completionPromptForRequest and
        contextShiftPromptLimit: num_ctx - max((num_ctx - num_keep) / 2, 1)). Returns the kept
        prompt's token count."""
        last = len(messages) - 1
        count = self._tokens(messages)
        for start in range(last + 1):
            system = [m for m in messages[:start] if m.get("role") == "system"]
            count = self._tokens(system + messages[start:])
            if count <= num_ctx:
                return count
        num_keep = min(4, num_ctx - 1)
        return num_ctx - max((num_ctx - num_keep) // 2, 1) if count > num_ctx - 1 else count

    async def _generate(self, body: dict[str, Any]) -> tuple[list[tuple[str, str]], str, int]:
        """The pieces of one answer, (kind, text), with its done_reason and prompt count."""
        messages = body.get("messages") or []
        if not messages or not any(m.get("role") == "user" for m in messages):
            return [], "load", 0
        options = body.get("options") or {}
        prompt = self._kept(messages, self._granted(options))
        self.prompts.append(prompt)
        budget = options.get("num_predict")
        think = self.thinking if body.get("think", True) is not False else 0
        pieces = [("thinking", f"hmm{i} ") for i in range(think)]
        pieces += [("content", f"word{i} ") for i in range(self.answer)]
        if isinstance(budget, int) and 0 < budget < len(pieces):
            return pieces[:budget], "length", prompt
        return pieces, "stop", prompt

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.in_flight += 1
        try:
            pieces, reason, prompt = await self._generate(body)
            started = time.monotonic_ns()
            stream = body.get("stream", True) is not False
            if reason == "load":
                final = {"model": body.get("model"), "created_at": "2026-12-05T00:00:00Z",
                         "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"}
                return web.json_response(final) if not stream else await self._ndjson(request, [final])
            lines = [{"model": body.get("model"), "created_at": "2026-12-05T00:00:00Z",
                      "message": {"role": "assistant", "content": text if kind == "content" else "",
                                  **({"thinking": text} if kind == "thinking" else {})}, "done": False}
                     for kind, text in pieces]
            final = {"model": body.get("model"), "created_at": "2026-12-05T00:00:00Z",
                     "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": reason,
                     "total_duration": time.monotonic_ns() - started + 1000, "load_duration": 100,
                     "prompt_eval_count": prompt, "prompt_eval_duration": 500,
                     "eval_count": len(pieces), "eval_duration": 400}
            if stream:
                return await self._ndjson(request, [*lines, final])
            await asyncio.sleep(self.token_delay_s * len(pieces))  # generating, while others come in
            content = "".join(t for k, t in pieces if k == "content")
            thinking = "".join(t for k, t in pieces if k == "thinking")
            final["message"] = {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {})}
            return web.json_response(final)
        finally:
            self.in_flight -= 1

    async def _ndjson(self, request: web.Request, lines: list[dict[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for number, line in enumerate(lines):
            await asyncio.sleep(self.token_delay_s)
            await response.write(orjson.dumps(line) + b"\n")
            if self.unload_mid_answer and number == len(lines) // 2:
                # The model leaves under the answer (a load cancelled, an eviction): /api/ps stops
                # listing it, and the runner's stream ends without a final line.
                self.loaded = False
                await asyncio.sleep(0.3)
                assert request.transport is not None
                request.transport.close()
                return response
        await response.write_eof()
        return response

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        """Ollama's OpenAI-compatible chat (openai/openai.go): thinking as `reasoning`."""
        body = orjson.loads(await request.read())
        options = {"num_predict": body.get("max_tokens")} if body.get("max_tokens") else {}
        self.in_flight += 1
        try:
            pieces, reason, prompt = await self._generate({**body, "options": options})
        finally:
            self.in_flight -= 1
        finish = {"stop": "stop", "length": "length", "load": "stop"}[reason]
        usage = {"prompt_tokens": prompt, "completion_tokens": len(pieces), "total_tokens": prompt + len(pieces)}
        base = {"id": "chatcmpl-123", "created": 1796000000, "model": body.get("model"),
                "system_fingerprint": "fp_ollama"}
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for number, (kind, text) in enumerate(pieces):
                # Delta's fields are all omitempty; the role comes with the first chunk only.
                delta: dict[str, Any] = {"role": "assistant"} if number == 0 else {}
                delta["reasoning" if kind == "thinking" else "content"] = text
                chunk = {**base, "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                await asyncio.sleep(self.token_delay_s)
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            last = {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
            await response.write(b"data: " + orjson.dumps(last) + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                tail = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                await response.write(b"data: " + orjson.dumps(tail) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        content = "".join(t for k, t in pieces if k == "content")
        thinking = "".join(t for k, t in pieces if k == "thinking")
        message = {"role": "assistant", "content": content, **({"reasoning": thinking} if thinking else {})}
        return web.json_response({**base, "object": "chat.completion", "usage": usage,
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
