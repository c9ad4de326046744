"""Write a tiny Llama-architecture model in Hugging Face format that vLLM's CPU build serves, made here.

No download: the tokenizer is a byte-level BPE trained here with `tokenizers` on a generated
corpus, the weights are set by hand with `transformers` and torch, and a chat template is
included. About 6 MB. Its behaviour is exact, so the tests know the truth:

* It is a bigram model. Attention and MLP write nothing back (their output projections are 0),
  so the next token depends only on the current one: logits = lm_head(norm(embedding)).
* Greedy decoding walks a fixed chain of CHAIN_LENGTH distinct tokens. The chat prompt ends with
  the `<|assistant|>` token, whose successor is the chain's first token; any other token leads
  there too (a bias on the chain's start through a constant dimension every embedding carries).
* With `eos_after=N` the N-th chain token is followed by EOS: every chat answer ends on its own
  after exactly N tokens (N + 1 with the EOS). Without it the chain is a cycle and EOS, like every
  special token, is never sampled: an answer ends only at a budget, a stop string or the context.
* Every MULTIBYTE_EVERY-th step of the chain is a two-byte UTF-8 character spelled as its two
  byte tokens. vLLM's incremental detokenizer holds the first byte back, so that token's chunk
  says `"content": ""`: even a single stream has fewer non-empty chunks than tokens.

`chain.json` beside the model lists the chain's token ids and the text of each step, so a test
can name a stop string the answer will reach, or the text an answer of k tokens has.

Run with an interpreter that has torch, transformers and tokenizers (the vLLM environment):
`python tests/real_servers/vllm/make_tiny_hf_model.py OUT_DIR [--eos-after N]`.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path
from typing import Any

SEED = 20240601
HIDDEN = 384
HEADS = 6  # head size 64: vLLM's CPU attention supports 32, 64, 80, ...
LAYERS = 2
INTERMEDIATE = 512
VOCAB_SIZE = 1024
MAX_POSITIONS = 8192
CHAIN_LENGTH = 300
MULTIBYTE_EVERY = 10  # every 10th step of the chain is a two-byte character (two tokens)
CHAIN_WEIGHT = 3.0  # how strongly a chain token predicts its successor
START_BIAS = 1.0  # how strongly any token leads to the chain's first token
FORBIDDEN_WEIGHT = -10.0  # special tokens are never sampled (EOS too, unless eos_after)
BOS, EOS = "<s>", "</s>"
SPECIALS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Made-up words from syllables: enough distinct words for a vocabulary of VOCAB_SIZE merges.
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
WORDS = [SYLLABLES[i % 70] + SYLLABLES[i // 70 % 70] + SYLLABLES[(i * 13 + 7) % 70][: 1 + i % 2]
         for i in range(700)]


def corpus() -> list[str]:
    """Deterministic sentences over WORDS: what the BPE learns its merges from."""
    lines = []
    for i in range(3000):
        words = [WORDS[(i * 7 + j * 13 + (i * j) % 5) % len(WORDS)] for j in range(12)]
        lines.append(" ".join(words).capitalize() + ".")
    return lines


def train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    return tokenizer


def byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode, as the ByteLevel pre-tokenizer uses it: byte -> its character."""
    # GPT-2's bytes_to_unicode, as ByteLevel uses it.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_token_ids(tokenizer: Any) -> dict[int, int]:
    """Token id of each single byte."""
    return {b: tokenizer.token_to_id(char) for b, char in byte_alphabet().items()}


def streamed_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each token adds when decoded incrementally: '' for a byte that starts a character."""
    to_byte = {char: b for b, char in byte_alphabet().items()}
    decoder = codecs.getincrementaldecoder("utf-8")()
    return [decoder.decode(bytes(to_byte[c] for c in tokenizer.id_to_token(i))) for i in ids]


def chain_ids(tokenizer: Any) -> list[int]:
    """The chain: word tokens of the trained vocabulary, with two-byte characters woven in."""
    special_ids = {tokenizer.token_to_id(s) for s in SPECIALS}
    by_byte = byte_token_ids(tokenizer)
    words = [i for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
             if i not in special_ids and len(token) > 2 and tokenizer.decode([i]).strip().isalpha()]
    # Two-byte characters with distinct lead and continuation bytes: U+00C0.. spread over leads
    # 0xC3..0xDF, each byte token used once in the whole chain.
    multibyte = []
    for k, lead in enumerate(range(0xC3, 0xE0)):
        continuation = 0x80 + k
        multibyte.append((by_byte[lead], by_byte[continuation]))
    chain: list[int] = []
    word_iter = iter(words)
    step = 0
    while len(chain) < CHAIN_LENGTH:
        step += 1
        if step % MULTIBYTE_EVERY == 0 and multibyte:
            chain.extend(multibyte.pop(0))
        else:
            chain.append(next(word_iter))
    chain = chain[:CHAIN_LENGTH]
    assert len(set(chain)) == len(chain), "a chain token may appear only once"
    return chain


def build(out: Path, eos_after: int | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = train_tokenizer()
    chain = chain_ids(tokenizer)
    if eos_after is not None and not 1 <= eos_after <= len(chain):
        raise ValueError(f"eos_after must be 1 to {len(chain)}")
    vocab = tokenizer.get_vocab_size()
    eos_id, start_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id("<|assistant|>")
    special_ids = [tokenizer.token_to_id(s) for s in SPECIALS]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=eos_id, torch_dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED)
    # Directions in dimensions 1..: orthonormal for the chain and its starter, the other tokens
    # drawn from the rest of the space, so they predict nothing on the chain (no cross-talk).
    linked = [start_id, *chain]
    q, _ = torch.linalg.qr(torch.randn(HIDDEN - 1, HIDDEN - 1, generator=generator))
    chain_basis, rest = q[:, :len(linked)], q[:, len(linked):]
    directions = rest @ torch.randn(rest.shape[1], vocab, generator=generator)
    directions = directions / directions.norm(dim=0, keepdim=True)
    directions[:, linked] = chain_basis
    with torch.no_grad():
        embed = torch.zeros(vocab, HIDDEN)
        embed[:, 0] = 1.0
        embed[:, 1:] = directions.T
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, HIDDEN)
        head[chain[0], 0] = START_BIAS
        head[special_ids, 0] = FORBIDDEN_WEIGHT
        successors = [*chain[1:], chain[0]]
        for current, successor in zip(linked, [chain[0], *successors], strict=True):
            head[successor, 1:] += CHAIN_WEIGHT * directions[:, current]
        if eos_after is not None:
            head[eos_id, 0] = 0.0
            head[eos_id, 1:] = 2 * CHAIN_WEIGHT * directions[:, chain[eos_after - 1]]
        model.lm_head.weight.copy_(head)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   additional_special_tokens=SPECIALS[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    texts = streamed_texts(tokenizer, chain)
    (out / "chain.json").write_text(json.dumps({
        "eos_after": eos_after, "chain": chain, "texts": texts, "eos_id": eos_id,
        "answer": "".join(texts[: eos_after or len(chain)])}, ensure_ascii=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--eos-after", type=int, default=None, metavar="N",
                        help="end every chat answer with EOS after N tokens (default: never EOS)")
    args = parser.parse_args()
    path = build(args.out, args.eos_after)
    size = sum(p.stat().st_size for p in path.iterdir())
    print(f"{path} ({size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
