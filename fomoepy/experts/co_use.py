"""`lfu-cooc`: the experts of one token announce the experts of the next.

Consecutive tokens reuse experts well beyond what each expert's overall frequency says (on the demo
traces, about half of the misses of a frequency policy are experts used within the last few tokens),
and which ones come back depends on which were just used. The policy keeps, per expert a, how often
each expert b was used in the token after a use of a (co-use counts C, halved every
`co_half_life_tokens`), and ranks a resident expert b by

    score(b) = decayed use count of b  +  weight · Σ over a used in the last token  C[a, b] / N[a]

where N[a] counts a's uses: the second term is the expected number of uses of b in this token that
the last token announces. Everything else is lfu-demote's: exclusive tiers, the same admission test
(on this score), duplicates evicted first. `weight` (4) was tuned on the demo-project trace only
(4-16 were within 0.5 points there); it is scored on demo-heldout.

Cost: the announced uses are summed once per token (one row of C per expert of the last token), and
an eviction sorts the tier's residents by score (the term changes every token, so no heap keeps them).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from fomoepy.experts.policy import DemotingFrequencyPolicy, Key


class CoUsePolicy(DemotingFrequencyPolicy):
    name = "lfu-cooc"

    def __init__(self, half_life_tokens: float = 64.0, weight: float = 4.0, co_half_life_tokens: int = 1024):
        super().__init__(half_life_tokens)
        self.weight = weight
        self.co_half_life = co_half_life_tokens
        self._co: dict[Key, dict[Key, float]] = {}  # a → {b: uses of b in the token after a use of a}
        self._uses: dict[Key, float] = {}  # N[a], halved with C
        self._now = -1
        self._last: list[Key] = []  # experts of the previous token
        self._current: list[Key] = []  # experts of this token so far
        self._announced: dict[Key, float] = {}  # b → Σ over the last token's a of C[a, b] / N[a]
        self._halved_at = 0

    def observe(self, key: Key, now: int) -> None:
        super().observe(key, now)
        if now != self._now:
            self._next_token(now)
        for a in self._last:
            row = self._co.setdefault(a, {})
            row[key] = row.get(key, 0.0) + 1.0
        self._uses[key] = self._uses.get(key, 0.0) + 1.0
        self._current.append(key)

    def _next_token(self, now: int) -> None:
        self._now = now
        self._last, self._current = self._current, []
        if now - self._halved_at >= self.co_half_life:
            self._halved_at = now
            for row in self._co.values():
                for b in row:
                    row[b] *= 0.5
            for a in self._uses:
                self._uses[a] *= 0.5
        announced: dict[Key, float] = {}
        for a in self._last:
            row = self._co.get(a)
            if row:
                scale = 1.0 / self._uses[a]
                for b, c in row.items():
                    announced[b] = announced.get(b, 0.0) + c * scale
        self._announced = announced

    def score(self, key: Key, now: int) -> float:
        return self.freq.score(key, now) + self.weight * self._announced.get(key, 0.0)

    def admits(self, key: Key, victims: Sequence[Key], now: int) -> bool:
        worst = max((self.score(v, now) for v in victims if v not in self._duplicates), default=0.0)
        return self.score(key, now) + 1.0 > worst

    def eviction_order(self) -> Generator[Key, None, None]:
        tracked = self.freq._tracked
        yield from sorted(k for k in self._duplicates if k in tracked)
        now = self._now
        rest = [k for k in tracked if k not in self._duplicates]
        rest.sort(key=lambda k: (self.score(k, now), k))
        yield from rest
