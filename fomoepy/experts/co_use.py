"""`lfu-cooc`: the experts of one token announce the experts of the next.

Consecutive tokens reuse experts well beyond what each expert's overall frequency says, and which ones
come back depends on which were just used. The policy counts, for experts a and b of the same layer,
how often b was used in the token after a use of a (co-use counts C, halved every
`co_half_life_tokens`; each a keeps its `successors` most counted b), and ranks a resident expert b by

    score(b) = decayed use count of b  (half-life `half_life_tokens`)
             + weight_next · Σ over a used so far in this token  C[a, b] / N[a]   (b in the next token)
             + weight_this · Σ over a used in the last token     C[a, b] / N[a]   (b in this token)

where N[a] counts a's uses: each sum is the expected number of uses of b that the experts just seen
announce. Everything else is lfu-demote's: exclusive tiers, the same admission test (on this score),
duplicates evicted first.

Tuned on the demo-project trace only (bench/simulate_trace.py scores it on demo-heldout). At 10 % +
25 % there, of Belady's memory hit rate: lfu-demote 0.79; announcements with lfu-admit's half-life
(64 tokens) +0.4 points, with a half-life of 16 tokens +2 (8-32 tokens and weights 1-6 were within
0.5 points). Counting pairs across layers too gained 0.4 more, at a cost per use that grows with
the experts per token, so pairs stay within a layer.
Knowing the next token's experts exactly would gain about 3 points of hit rate (replaying one cache of
the same size).

Cost: a use adds one count per expert its layer used in the last token and sums one row of C (at
most 2 x `successors` entries); an eviction walks the frequency heap lazily, merging in the
announcements (eviction_order). At 60 layers x 512 experts, top-10 (synthetic routing), both tiers'
bookkeeping takes 1.34 ms per layer step against lfu-admit's 0.55 and lfu-demote's 0.37 (idle 2-core
machine; most of it in eviction_order, and each tier keeps its own counts of the same stream);
counting pairs across layers as well took ~0.1 s. Announced experts sit low in the frequency heap, so
a walk passes many of them before it may yield: on the bench model's host tier (128 residents) a walk
read 63 on average to yield 1.2, which is why reads made outside a plan are admitted in one plan per
layer step (ExpertCache.admit_host), not one each.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Sequence
from contextlib import closing

from fomoepy.experts.policy import (
    AdmittingFrequencyPolicy,
    DemotingFrequencyPolicy,
    Key,
)


class CoUseCounts:
    """What the policy learns from the stream of uses: the co-use counts C and N, the experts of the last
    token and of this one, and the announcements they make. One set serves both tiers (learn_with)."""

    def __init__(self, weight_next: float, weight_this: float, co_half_life_tokens: int, successors: int):
        self.successors = successors
        self.weight_next, self.weight_this = weight_next, weight_this
        self.co_half_life = co_half_life_tokens
        self.co: dict[Key, dict[Key, float]] = {}  # a → {b: uses of b in the token after a use of a}
        self.uses: dict[Key, float] = {}  # N[a], halved with C
        self.now = -1
        # experts of each sequence's previous token, and of this token so far, by (sequence, layer): a step
        # that decodes several sequences counts each one's co-use from its own previous token
        self.last: dict[tuple[int, int], list[Key]] = {}
        self.current: dict[tuple[int, int], list[Key]] = {}
        self.announced: dict[Key, float] = {}  # b → the two weighted sums above
        self.halved_at = 0

    def observe(self, key: Key, now: int, sequence: int = 0) -> None:
        if now != self.now:
            self._next_token(now)
        for a in self.last.get((sequence, key[0]), ()):
            row = self.co.setdefault(a, {})
            row[key] = row.get(key, 0.0) + 1.0
            if len(row) > 2 * self.successors:
                self.co[a] = dict(heapq.nlargest(self.successors, row.items(), key=lambda kv: kv[1]))
        self.uses[key] = self.uses.get(key, 0.0) + 1.0
        self.current.setdefault((sequence, key[0]), []).append(key)
        self._announce(self.announced, key, self.weight_next)

    def _next_token(self, now: int) -> None:
        self.now = now
        self.last, self.current = self.current, {}
        if now - self.halved_at >= self.co_half_life:
            self.halved_at = now
            for row in self.co.values():
                for b in row:
                    row[b] *= 0.5
            for a in self.uses:
                self.uses[a] *= 0.5
        announced: dict[Key, float] = {}
        for keys in self.last.values():
            for a in keys:
                self._announce(announced, a, self.weight_this)
        self.announced = announced

    def _announce(self, announced: dict[Key, float], a: Key, weight: float) -> None:
        row = self.co.get(a)
        if row:
            scale = weight / self.uses[a]
            for b, c in row.items():
                announced[b] = announced.get(b, 0.0) + c * scale


class CoUsePolicy(DemotingFrequencyPolicy):
    name = "lfu-cooc"

    def __init__(
        self,
        half_life_tokens: float = 16.0,
        weight_next: float = 4.0,
        weight_this: float = 2.0,
        co_half_life_tokens: int = 1024,
        successors: int = 16,
    ):
        super().__init__(half_life_tokens)
        self.counts = CoUseCounts(weight_next, weight_this, co_half_life_tokens, successors)

    def learn_with(self, other: AdmittingFrequencyPolicy) -> None:
        super().learn_with(other)
        if isinstance(other, CoUsePolicy):
            other.counts = self.counts

    def observe(self, key: Key, now: int, sequences: Sequence[int] = (0,)) -> None:
        super().observe(key, now)
        if self._learns:
            for sequence in sequences:
                self.counts.observe(key, now, sequence)

    def score(self, key: Key, now: int) -> float:
        return self.freq.score(key, now) + self.counts.announced.get(key, 0.0)

    def admits(self, key: Key, victims: Sequence[Key], now: int) -> bool:
        worst = max((self.score(v, now) for v in victims if v not in self._duplicates), default=0.0)
        return self.score(key, now) + 1.0 > worst

    def eviction_order(self) -> Generator[Key, None, None]:
        # The frequency heap gives residents by ascending use count f; an announcement only raises a
        # score, so once the stream reaches f, no key still to come scores below f: everything pending
        # at or below it goes out in score order. Lazy: a few evictions cost a few heap steps.
        with closing(self._duplicates_in_order()) as duplicates:
            yield from duplicates
        now, announced = self.counts.now, self.counts.announced
        pending: list[tuple[float, Key]] = []
        with closing(self.freq.eviction_order()) as order:
            for key in order:
                if key in self._duplicates:
                    continue
                f = self.freq.score(key, now)
                while pending and pending[0][0] <= f:
                    yield heapq.heappop(pending)[1]
                heapq.heappush(pending, (f + announced.get(key, 0.0), key))
        while pending:
            yield heapq.heappop(pending)[1]
