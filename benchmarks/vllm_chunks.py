"""How many tokens one streamed chunk carries on a real server under load: the undercount of a count.

Without a usage chunk (the `openai` client's default when streaming) the proxy can only count the
chunks that carry text, and that count is a lower bound: vLLM sends `"content": ""` for a token that
is part of a multi-byte character (or held back by the detokenizer), and under load one chunk can
carry several tokens. This streams C concurrent chats R times with `include_usage`, and compares
the server's own count with the chunks a client sees.

    python benchmarks/vllm_chunks.py --target http://127.0.0.1:8000 --model NAME [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
import orjson


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, int, int]:
    """(tokens the server counted, chunks with a delta other than the role chunk, chunks with text)."""
    usage = chunks = with_text = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        buffer = await response.read()
    for line in buffer.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event: Any = orjson.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if "role" in delta:
                continue
            chunks += 1
            with_text += bool(delta.get("content"))
    return usage, chunks, with_text


async def level(target: str, model: str, concurrency: int, rounds: int, max_tokens: int) -> list[tuple[int, int, int]]:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                         "max_tokens": max_tokens, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}})
    url = target.rstrip("/") + "/v1/chat/completions"
    results: list[tuple[int, int, int]] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            results += await asyncio.gather(*(one_stream(session, url, body) for _ in range(concurrency)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--target", required=True, help="the server (or the proxy in front of it)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default="1,8", help="levels, comma-separated (default 1,8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    print("streams  tokens/stream  chunks/token  text chunks/token  lowest text chunks/token  seconds")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        started = time.monotonic()
        results = asyncio.run(level(args.target, args.model, concurrency, args.rounds, args.max_tokens))
        seconds = time.monotonic() - started
        counted = [r for r in results if r[0]]
        tokens = statistics.mean(r[0] for r in counted)
        chunks = sum(r[1] for r in counted) / sum(r[0] for r in counted)
        text = sum(r[2] for r in counted) / sum(r[0] for r in counted)
        lowest = min(r[2] / r[0] for r in counted)
        print(f"{concurrency:7d}  {tokens:13.1f}  {chunks:12.3f}  {text:17.3f}  {lowest:24.3f}  {seconds:7.1f}")


if __name__ == "__main__":
    main()
