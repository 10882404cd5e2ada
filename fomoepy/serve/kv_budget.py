"""The daemon's KV memory budget: plain integers, no arrays (like a block manager, it never touches a
tensor), so the admission rule is testable alone.

A request entering the batch reserves the bytes its state can reach: its prompt plus max_tokens, capped
at the context (`worst_tokens`), priced by the engine's `kv_nbytes` (KV caches grow by whole chunks).
The state itself still allocates only what it uses; the reservation is what guarantees that a
sequence admitted never fails mid-stream for memory. A paused request keeps only the bytes its state
holds now (or none, once it has given its state up to a waiting request: the worker's preemption), and
reserves its worst case again before it re-enters the batch. A request whose worst
case exceeds the whole budget is refused with one clear error; one that fits the budget but not what
is left waits in the queue (the head of the fair order waits, so a large request is not starved).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable


class KVBudget:
    def __init__(self, limit: int, nbytes: Callable[[int], int], n_ctx: int):
        """limit: bytes; nbytes(n_tokens): bytes of a state holding n_tokens; n_ctx: the context."""
        if limit < 1:
            raise ValueError(f"the KV budget must be >= 1 byte, got {limit}")
        self.limit = limit
        self.nbytes = nbytes
        self.n_ctx = n_ctx
        self._held: dict[Hashable, int] = {}

    def worst_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        return min(self.n_ctx, prompt_tokens + max_tokens)

    @property
    def reserved(self) -> int:
        return sum(self._held.values())

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be served within the budget, or None."""
        n = self.worst_tokens(prompt_tokens, max_tokens)
        need = self.nbytes(n)
        if need <= self.limit:
            return None
        return (
            f"up to {n} tokens ({prompt_tokens} prompt + max_tokens {max_tokens}, context {self.n_ctx}) need "
            f"{_mib(need)} of KV cache, more than the daemon's KV budget of {_mib(self.limit)} (--kv-budget)"
        )

    def can_reserve(self, key: Hashable, n_tokens: int, freed: int = 0) -> bool:
        """Whether `key` could hold its worst case of n_tokens, with `freed` bytes others hold released first."""
        return self.reserved - freed - self._held.get(key, 0) + self.nbytes(n_tokens) <= self.limit

    def reserve(self, key: Hashable, n_tokens: int) -> None:
        if not self.can_reserve(key, n_tokens):
            raise ValueError(f"expected room for {self.nbytes(n_tokens)} bytes, {self.limit - self.reserved} left")
        self._held[key] = self.nbytes(n_tokens)

    def hold_only(self, key: Hashable, nbytes: int) -> None:
        """A paused request: keep only what its state holds now."""
        if key in self._held:
            self._held[key] = min(self._held[key], nbytes)

    def held(self, key: Hashable) -> int:
        """Bytes `key` holds (0: none)."""
        return self._held.get(key, 0)

    def release(self, key: Hashable) -> None:
        self._held.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
