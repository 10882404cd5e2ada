"""Perplexity as llama.cpp's `llama-perplexity` computes it, on arrays: chunks, NLLs, running PPL, error.

The method (llama.cpp tools/perplexity/perplexity.cpp, `perplexity()`, default options):

- the text is tokenized once, whole (BOS first only where the model's `add_bos_token` says so);
- n_chunks = floor(n_tokens / n_ctx), or fewer with --chunks; the tail that does not fill a chunk is dropped;
- each chunk is evaluated from an empty state at positions 0..n_ctx-1, its first token replaced by BOS
  when the model adds BOS (that token is never scored);
- the logits at positions first = n_ctx/2 .. n_ctx-2 are scored, each predicting the next token:
  n_scored = n_ctx - 1 - first tokens per chunk;
- nll = logsumexp(logits) - logits[target]; PPL = exp(mean nll); the error is the standard error of the
  mean NLL carried over to PPL: PPL * sqrt((mean(nll^2) - mean(nll)^2) / (N - 1)).

Differences from llama.cpp that do not show at its printed precision: the NLL is taken in float64 from the
float32 logits (llama.cpp: float max, `expf`, a double sum), and sums are exactly rounded (`math.fsum`)
per chunk and over chunks, so that a run resumed from saved per-chunk sums ends on the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fomoepy.errors import FomoeError

# llama-perplexity's defaults: `-c 512` (its main() sets it) and `-b 2048` (common_params).
DEFAULT_CTX = 512
DEFAULT_BATCH = 2048


@dataclass(frozen=True)
class ChunkPlan:
    """Which tokens each chunk evaluates and scores. `bos_id` is set when chunks start with BOS."""

    n_ctx: int
    n_chunks: int
    bos_id: int | None = None

    @property
    def first(self) -> int:
        """First scored logit position of a chunk."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def n_tokens_used(self) -> int:
        return self.n_chunks * self.n_ctx

    def eval_tokens(self, tokens: np.ndarray, i: int) -> np.ndarray:
        """int64 [n_ctx]: what chunk i evaluates (first token replaced by BOS where the model adds BOS)."""
        chunk = np.array(tokens[i * self.n_ctx : (i + 1) * self.n_ctx], dtype=np.int64)
        if self.bos_id is not None:
            chunk[0] = self.bos_id
        return chunk

    def targets(self, tokens: np.ndarray, i: int) -> np.ndarray:
        """int64 [n_scored]: the tokens the scored positions predict (original ids, never BOS-replaced)."""
        start = i * self.n_ctx
        return np.asarray(tokens[start + self.first + 1 : start + self.n_ctx], dtype=np.int64)


def check_ctx(n_ctx: int) -> None:
    if n_ctx - 1 - n_ctx // 2 < 1:
        raise FomoeError(
            f"a context of {n_ctx} scores no token (positions ctx/2 .. ctx-2 are scored); use --ctx 3 or more"
        )


def plan_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None = None, bos_id: int | None = None) -> ChunkPlan:
    """llama-perplexity's chunking; max_chunks None or < 0 means every whole chunk.

    Like llama-perplexity, a text of fewer than 2 * n_ctx tokens is refused (even though one chunk would fit).
    """
    check_ctx(n_ctx)
    if n_tokens < 2 * n_ctx:
        raise TooFewTokens(n_tokens, n_ctx)
    n_chunks = n_tokens // n_ctx
    if max_chunks is not None and max_chunks >= 0:
        if max_chunks == 0:
            raise FomoeError("--chunks 0 leaves nothing to evaluate (a negative value means all chunks)")
        n_chunks = min(n_chunks, max_chunks)
    return ChunkPlan(n_ctx=n_ctx, n_chunks=n_chunks, bos_id=bos_id)


class TooFewTokens(FomoeError):
    def __init__(self, n_tokens: int, n_ctx: int):
        super().__init__(
            f"the text tokenizes to only {n_tokens} tokens; perplexity with a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (2 x ctx, as llama-perplexity)"
        )
        self.n_tokens, self.n_ctx = n_tokens, n_ctx


def batch_spans(n_ctx: int, n_batch: int) -> list[tuple[int, int]]:
    """[start, end) of each eval call within a chunk: one call when n_batch >= n_ctx, else n_batch-token pieces.

    llama-perplexity with n_batch >= n_ctx decodes floor(n_batch / n_ctx) chunks as parallel sequences of one
    batch; the engine evaluates one sequence per call, so here that is one call per chunk (same logits).
    """
    if n_batch < 1:
        raise FomoeError(f"--batch must be >= 1, got {n_batch}")
    step = min(n_batch, n_ctx)
    return [(s, min(s + step, n_ctx)) for s in range(0, n_ctx, step)]


def log_softmax_parts(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [S, V] logits → (float64 [S, V] logits, float64 [S] logsumexp)."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    return z, lse


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 [S]: -log softmax(logits[s])[targets[s]]."""
    z, lse = log_softmax_parts(logits)
    return lse - z[np.arange(len(targets)), targets]


@dataclass(frozen=True)
class ChunkNll:
    """What one chunk adds to the estimate; a resume file stores exactly these."""

    index: int
    count: int
    sum_nll: float
    sum_nll2: float

    @classmethod
    def of(cls, index: int, nll: np.ndarray) -> ChunkNll:
        nll = np.asarray(nll, dtype=np.float64)
        return cls(index, int(nll.size), math.fsum(nll.tolist()), math.fsum((nll * nll).tolist()))


@dataclass(frozen=True)
class PplEstimate:
    ppl: float
    err: float  # nan when the NLL variance is not positive (llama.cpp then prints no estimate)
    mean_nll: float
    count: int


def estimate(sum_nll: float, sum_nll2: float, count: int) -> PplEstimate:
    """llama.cpp's final estimate from the NLL sums."""
    mean = sum_nll / count
    ppl = math.exp(mean)
    var = sum_nll2 / count - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else math.nan
    return PplEstimate(ppl, err, mean, count)


class PplTotals:
    """Running totals over chunks added in order (0, 1, 2, ...)."""

    def __init__(self) -> None:
        self.chunks: list[ChunkNll] = []

    def add(self, chunk: ChunkNll) -> None:
        if chunk.index != len(self.chunks):
            raise ValueError(f"chunk index: expected {len(self.chunks)}, got {chunk.index}")
        self.chunks.append(chunk)

    def estimate(self) -> PplEstimate:
        return estimate(
            math.fsum(c.sum_nll for c in self.chunks),
            math.fsum(c.sum_nll2 for c in self.chunks),
            sum(c.count for c in self.chunks),
        )


def format_running(i: int, ppl: float) -> str:
    """llama-perplexity's progress item for chunk i (1-based): `[i]%.4f,`."""
    return f"[{i}]{ppl:.4f},"


def format_final(est: PplEstimate) -> str:
    return f"Final estimate: PPL = {est.ppl:.4f} +/- {est.err:.5f}"
