"""Write a tiny llama-architecture GGUF that llama-server loads and runs on a CPU, made here.

2 layers, 64-wide, a 354-token vocabulary, fixed seed, about 0.5 MB, no download. The weights
are random except for what makes its behaviour exact:

* Every prompt character is one token (each printable ASCII character is a vocabulary entry),
  so prompt sizes in tokens are exact and tests can fill a slot's context on purpose.
* It writes the 60-character cycle `CYCLE` ("abc...xyzABC...XYZ01234567abc..."): each cycle
  character's embedding is an orthonormal direction, and the output row of its successor reads
  that direction (a bigram chain carried by the residual stream). A chat answer starts at "a",
  since the chat prompt ends in "\n", which leads to "a" too.
* It never samples EOS, BOS, UNK or a raw byte token: dimension 0 of the residual stream is a
  constant (the embeddings carry it, no layer writes to it), and the output rows of those
  tokens weigh it strongly negative. A response therefore ends only at `max_tokens`, at a
  stop word, or when the slot's context is full, never by chance.
* Unless `eos_after=K` is given: then EOS follows the K-th cycle character, so every chat
  answer ends on its own after exactly K characters (K + 1 tokens with the EOS).

Run: `python tests/real_servers/llamacpp/make_tiny_gguf.py OUT.gguf [--eos-after K]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SEED = 20240601
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
N_CTX_TRAIN = 32768  # room for one long stream (the disconnect test)
RMS_EPS = 1e-5
# Output weight on the constant dimension for tokens that must never be sampled.
FORBIDDEN_LOGIT_WEIGHT = -40.0
CHAIN_WEIGHT = 3.0  # how strongly a cycle character predicts its successor
CYCLE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3  # <0x00>..<0xFF> follow: SPM needs them (llama.cpp finds '\n' as <0x0A>)
SPACE_ID = FIRST_BYTE_ID + 256  # "▁", SentencePiece's space
FIRST_CHAR_ID = SPACE_ID + 1  # the printable ASCII characters "!".."~", one token each
PRINTABLE = [chr(c) for c in range(0x21, 0x7F)]
N_VOCAB = FIRST_CHAR_ID + len(PRINTABLE)

# ChatML, rendered from plain characters: the tiny vocabulary has no special chat tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _import_gguf() -> object:
    """The `gguf` package from PyPI, else the gguf-py copy vendored next to the built server."""
    try:
        import gguf
    except ImportError:
        from tests.real_servers.llamacpp.llama_server import BUILD_DIR

        vendored = sorted(BUILD_DIR.glob("src/gguf-py"))
        if not vendored:
            raise
        sys.path.insert(0, str(vendored[-1]))
        import gguf
    return gguf


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types of the tiny SentencePiece ("llama") vocabulary."""
    gguf = _import_gguf()
    token_type = gguf.TokenType  # type: ignore[attr-defined]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", *PRINTABLE]
    types = [token_type.UNKNOWN, token_type.CONTROL, token_type.CONTROL]
    types += [token_type.BYTE] * 256 + [token_type.NORMAL] * (1 + len(PRINTABLE))
    scores = [0.0] * len(tokens)
    assert len(tokens) == N_VOCAB
    return tokens, scores, [int(t) for t in types]


def token_id(char: str) -> int:
    """The id of a printable character, or of a byte token for anything else (as SPM falls back)."""
    if char in PRINTABLE:
        return FIRST_CHAR_ID + PRINTABLE.index(char)
    return FIRST_BYTE_ID + ord(char)


def tensors(rng: np.random.Generator, eos_after: int | None = None) -> dict[str, np.ndarray]:
    """The weights, in numpy (out, in) layout: random, plus the constant dimension and the chain."""

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    head_dim = N_EMBD // N_HEAD
    out: dict[str, np.ndarray] = {}
    # Directions in dimensions 1..63: orthonormal for "\n" and the cycle (no cross-talk on the
    # chain), random unit vectors for every other token.
    directions = rng.normal(size=(N_VOCAB, N_EMBD - 1))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    chained = [token_id("\n")] + [token_id(c) for c in CYCLE]
    basis, _ = np.linalg.qr(rng.normal(size=(N_EMBD - 1, len(chained))))
    directions[chained] = basis.T
    embd = np.zeros((N_VOCAB, N_EMBD), dtype=np.float32)
    embd[:, 0] = 1.0  # the constant dimension
    embd[:, 1:] = directions
    out["token_embd.weight"] = embd
    for i in range(N_LAYER):
        attn_out = normal(N_EMBD, N_EMBD, std=0.005)
        attn_out[0, :] = 0.0  # no layer writes the constant dimension
        ffn_down = normal(N_EMBD, N_FF, std=0.005)
        ffn_down[0, :] = 0.0
        out[f"blk.{i}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        out[f"blk.{i}.attn_q.weight"] = normal(N_EMBD, N_EMBD, std=0.2)
        out[f"blk.{i}.attn_k.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD, std=0.2)
        out[f"blk.{i}.attn_v.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD, std=0.2)
        out[f"blk.{i}.attn_output.weight"] = attn_out
        out[f"blk.{i}.ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        out[f"blk.{i}.ffn_gate.weight"] = normal(N_FF, N_EMBD, std=0.2)
        out[f"blk.{i}.ffn_up.weight"] = normal(N_FF, N_EMBD, std=0.2)
        out[f"blk.{i}.ffn_down.weight"] = ffn_down
    out["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    output = normal(N_VOCAB, N_EMBD)
    output[:, 0] = 0.0
    output[:FIRST_CHAR_ID - 1, 0] = FORBIDDEN_LOGIT_WEIGHT  # unk, bos, eos and the 256 byte tokens
    # The chain: "\n" -> "a" -> "b" ... -> "7" -> "a".
    successors = [*chained[1:], chained[1]]
    for current, successor in zip(chained, successors, strict=True):
        output[successor, 1:] += CHAIN_WEIGHT * directions[current]
    if eos_after is not None:
        if not 1 <= eos_after <= len(CYCLE):
            raise ValueError(f"eos_after must be 1 to {len(CYCLE)}")
        output[EOS_ID, 0] = 0.0
        output[EOS_ID, 1:] = 2 * CHAIN_WEIGHT * directions[token_id(CYCLE[eos_after - 1])]
    out["output.weight"] = output
    return out


def write_tiny_gguf(path: Path, eos_after: int | None = None) -> Path:
    """Write the model to `path` (deterministic: same bytes on every run) and return the path."""
    gguf = _import_gguf()
    writer = gguf.GGUFWriter(str(path), "llama")  # type: ignore[attr-defined]
    writer.add_name("llm-diag-proxy tiny llama" + ("" if eos_after is None else f" (EOS after {eos_after})"))
    writer.add_file_type(0)  # all F32
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(N_VOCAB)
    tokens, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors(np.random.default_rng(SEED), eos_after).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the .gguf")
    parser.add_argument("--eos-after", type=int, default=None, metavar="K",
                        help="end every chat answer with EOS after K characters (default: never EOS)")
    args = parser.parse_args()
    path = write_tiny_gguf(args.out, args.eos_after)
    print(f"{path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
