"""Bytes to typed events, and nothing else.

Owns: line framing (`lines`), SSE and NDJSON (`sse`, `ndjson`), the parsers that turn a body into
events (`parsers`, `events`), the fast path for plain token events (`fast_tokens`), each server
dialect in one module (`dialects/`), and the process-wide bound on bytes held to be read
(`parse_bytes`). Pure: no sockets, no clocks.

Must not import: relay, diagnosis, observers, serve, sweep, simulator (only record, config,
processes).
"""
