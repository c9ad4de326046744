"""Seeded answers: the same seed and prompt give the same natural length and the same words."""

from __future__ import annotations

import hashlib
import random

# A small fixed vocabulary: the text is filler, only its length and timing matter.
VOCABULARY = (
    "the", "model", "answer", "token", "cache", "batch", "server", "request", "memory", "block",
    "length", "stream", "context", "sequence", "prompt", "queue", "budget", "latency", "decode",
    "prefill", "engine", "slot", "limit", "signal", "proxy", "client", "reason", "result", "value",
    "simple", "short", "long", "fast", "slow", "first", "last", "next", "every", "each", "some",
    "is", "was", "will", "can", "may", "and", "or", "but", "so", "then", "because", "when", "while",
    "of", "in", "on", "to", "for", "with", "from", "by", "at", "as", "it",
)
SENTENCE_WORDS = 12  # a full stop about every this many words, so the text reads like sentences


def estimate_prompt_tokens(text: str) -> int:
    """The simulator's tokenizer: about four characters per token (an estimate, like any server's)."""
    return max(1, -(-len(text) // 4)) if text else 0


def seed_for(seed: int, prompt: str) -> int:
    """A stable 64-bit seed from a request seed and its prompt (Python's hash() is salted)."""
    digest = hashlib.blake2b(f"{seed}\x00{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class AnswerSampler:
    """Draws one answer: its natural length (where EOS comes) and its words, token by token."""

    __slots__ = ("_count", "_rng", "_seed", "natural_tokens")

    def __init__(self, seed: int, prompt: str, mean_tokens: int, spread: float) -> None:
        self._seed = seed_for(seed, prompt)
        self._rng = random.Random(self._seed)
        low = mean_tokens * (1 - spread)
        self.natural_tokens = max(1, round(low + 2 * mean_tokens * spread * self._rng.random()))
        self._count = 0

    def perturbed(self, text: str, batch: int, share: float) -> str:
        """The token as a batch of `batch` computes it: with probability `share` another word, drawn
        from the batch's shape, the seed and the position (repeatable, and apart from the seeded draw)."""
        rng = random.Random(hash((self._seed, self._count, batch)))
        if rng.random() >= share:
            return text
        word = VOCABULARY[rng.randrange(len(VOCABULARY))]
        return word.capitalize() if self._count == 1 else f" {word}." if text.endswith(".") else f" {word}"

    def next_token(self) -> str:
        """The next token's text: a word with its leading space, sometimes ending a sentence."""
        word = VOCABULARY[self._rng.randrange(len(VOCABULARY))]
        self._count += 1
        if self._count == 1:
            return word.capitalize()
        if self._count % SENTENCE_WORDS == 0:
            return f" {word}."
        return f" {word}"
