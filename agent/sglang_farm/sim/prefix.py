"""Pure: the simulator's prefix (radix) cache: which of a prompt's leading tokens it holds.

SGLang keeps the KV of prompts it has served in a radix tree over their tokens; a new
request whose prompt starts with a cached prefix skips the prefill of that prefix
(`--disable-radix-cache` turns it off), and evicts the least recently used entries when
the pool needs room. The simulator models that with blocks: a prompt's text is cut into
blocks of `BLOCK_TOKENS` tokens (the simulator's token is four characters), each named by
a hash of everything up to its end, so two prompts share a block exactly when they share
the whole prefix up to it. The cache is an LRU of block names with a capacity in tokens;
`admit` returns how many of the prompt's tokens were found (a run of leading blocks) and
caches the rest. As in SGLang, at least the prompt's last token is always computed
(`cached <= prompt_tokens - 1`).

What the engine does with it (engine.py): the request's prefill takes
`SGLANG_SIM_PREFILL_TOKEN_SECONDS` per *uncached* prompt token before its first token;
the answer's `usage.prompt_tokens_details.cached_tokens` (with `--enable-cache-report`)
and the gauge `sglang:cache_hit_rate` come from the same count.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the simulator's tokens (web._prompt_tokens)
BLOCK_TOKENS = 16  # tokens per cached block (a page of 16, the unit a hit counts in)


def blocks(text: str) -> tuple[bytes, ...]:
    """The names of `text`'s whole blocks, in order: block i's name is the hash of the
    text up to its end (chained, so equal names mean an equal prefix). A tail shorter than
    a block is not cached."""
    size = BLOCK_TOKENS * CHARS_PER_TOKEN
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    for end in range(size, len(text) + 1, size):
        h.update(text[end - size : end].encode("utf-8", "surrogatepass"))
        out.append(h.copy().digest())
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Hit:
    """One admission: the prompt's tokens and how many of them the cache held."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class PrefixCache:
    """An LRU of prompt blocks holding at most `capacity_tokens` tokens (0: no cache, as
    `--disable-radix-cache`). Not thread-safe: the engine calls it under its lock."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(
                f"a prefix cache's capacity must be >= 0 tokens, got {capacity_tokens}"
            )
        self.capacity_blocks = capacity_tokens // BLOCK_TOKENS
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.evicted_blocks = 0

    @property
    def cached_blocks(self) -> int:
        return len(self._lru)

    def admit(self, names: Sequence[bytes], prompt_tokens: int) -> Hit:
        """A request with these leading block names (`blocks(text)`) and `prompt_tokens`
        tokens: the leading run of names the cache holds is a hit (each one made most
        recently used); the rest are cached (as many as fit), evicting the least recently
        used."""
        if self.capacity_blocks == 0 or prompt_tokens <= 0:
            return Hit(max(0, prompt_tokens), 0)
        matched = 0
        for name in names:
            if name not in self._lru:
                break
            matched += 1
        # Made most recently used from the tail to the head, so that the prompt's first
        # blocks are evicted last (a radix tree drops leaves before the prefix they hang on).
        for name in reversed(names[: self.capacity_blocks]):
            self._lru[name] = None
            self._lru.move_to_end(name)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
            self.evicted_blocks += 1
        cached = min(matched * BLOCK_TOKENS, prompt_tokens - 1)
        return Hit(prompt_tokens, max(0, cached))

    def clear(self) -> None:
        """`/flush_cache`: everything forgotten."""
        self._lru.clear()


@dataclass(frozen=True, slots=True)
class HitRate:
    """Prompt tokens and cached ones over some prefills; `rate` their ratio."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def plus(self, hit: Hit) -> HitRate:
        return HitRate(
            self.prompt_tokens + hit.prompt_tokens, self.cached_tokens + hit.cached_tokens
        )

    @property
    def rate(self) -> float | None:
        """None: no prefill to say anything about."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None
