"""The perplexity run: tokenize once, evaluate chunk by chunk as batched prefill, print like llama-perplexity.

Output streams (llama-perplexity writes progress with LOG to stdout and everything else with LOG_INF to stderr):

- stdout, PPL mode: `[1]778.8522,[2]760.1456,...` as chunks finish (llama-perplexity's `[%d]%.4f,`), a newline,
  then `Final estimate: PPL = %.4f +/- %.5f`. llama-perplexity prints that last line on stderr; here it is the
  last line of stdout, so `fomoe ppl ... > out.txt` keeps the result (and `2>&1` pipelines still see it).
- stdout, KL mode (`--kl`): llama-perplexity's per-chunk table and its three summary blocks.
- stderr: everything else (model, token and chunk counts, the chunk plan, timing, which caches reset, resume
  notes, engine stats).

With `--resume FILE`, every finished chunk is appended to FILE (see `journal`) and, with `--kl-base`, its record
to the base file, both fsynced; a rerun with the same arguments replays the finished chunks (printing what they
printed) and evaluates the rest.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.eval import kl as klm
from fomoepy.eval.journal import Journal
from fomoepy.eval.klfile import KlBase, KlBaseWriter
from fomoepy.eval.ppl import (
    ChunkNll,
    ChunkPlan,
    PplTotals,
    batch_spans,
    format_final,
    format_running,
    plan_chunks,
    token_nll,
)
from fomoepy.experts.device import Phase

BLOCK_ELEMENTS = 1 << 22  # scored rows x vocabulary handled at once in float64 (32 MiB a temporary)


@dataclass(frozen=True)
class PplRequest:
    model: str
    text_file: str | None
    n_ctx: int
    n_batch: int
    max_chunks: int | None = None
    resume: str | None = None
    kl_base_out: str | None = None
    kl_top_k: int | None = None  # None: klm.default_top_k(n_vocab)
    reset_cache_per_chunk: bool = False
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # recorded in the resume file


def read_text(path: str) -> tuple[str, bytes]:
    """The text llama-perplexity's `-f` reads: the file's bytes, UTF-8, minus one trailing "\\n"."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FomoeError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FomoeError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    return text.removesuffix("\n"), data


def tokenize_text(engine: Any, text: str) -> np.ndarray:
    tok = engine.tokenizer
    if tok.add_eos:
        raise FomoeError("the model's tokenizer appends EOS to every text (add_eos_token); llama-perplexity refuses it too")
    return np.asarray(tok.encode(text, add_special=True, parse_special=False), dtype=np.int64)


def model_fingerprint(path: str) -> dict[str, Any]:
    """Size and a SHA-256 of the first 16 MiB (header, metadata, tensor index) and the last 1 MiB."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(16 << 20))
        if size > 17 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return {"bytes": size, "sha256_head_tail": h.hexdigest()}


def tokens_sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest()


def scored_logits(engine: Any, chunk: np.ndarray, spans: list[tuple[int, int]], plan: ChunkPlan,
                  phase: Phase = Phase.PREFILL) -> np.ndarray:  # fmt: skip
    """float32 [n_scored, V]: logits of positions first .. n_ctx-2 of one chunk, from an empty state."""
    state = engine.new_state()
    parts = []
    for s, e in spans:
        # the output head only for the rows scored: positions before `first` are context alone
        first = min(max(plan.first - s, 0), e - s)
        logits = engine.eval(state, chunk[s:e], all_logits=True, phase=phase, logits_from=first)  # [e - s - first, V]
        if e > plan.first:
            parts.append(logits)  # [e - max(s, first), V]
    return np.concatenate(parts)[: plan.n_scored]


def _blocks(n_rows: int, n_vocab: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // n_vocab)
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _concat_rows(parts: list[klm.BaseRows]) -> klm.BaseRows:
    ids = None if parts[0].ids is None else np.concatenate([p.ids for p in parts])  # type: ignore[misc]
    return klm.BaseRows(
        ids,
        np.concatenate([p.logp for p in parts]),
        np.concatenate([p.log_tail for p in parts]),
        np.concatenate([p.nll for p in parts]),
    )


def _concat_tokens(parts: list[klm.KlTokens]) -> klm.KlTokens:
    return klm.KlTokens(*(np.concatenate([getattr(p, f) for p in parts]) for f in klm.KlTokens.__dataclass_fields__))


class PplRun:
    """One run over an opened engine. `base` given: KL mode against it; else PPL mode."""

    def __init__(
        self,
        engine: Any,
        req: PplRequest,
        base: KlBase | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ):
        self.engine, self.req, self.base = engine, req, base
        self.out = out if out is not None else sys.stdout  # looked up now, not at import (redirections)
        self.err = err if err is not None else sys.stderr
        self.n_vocab = engine.spec.n_vocab
        self.n_evaluated = 0
        self.eval_seconds = 0.0
        self.totals = PplTotals()  # PPL mode
        self.kl_sums: list[klm.KlSums] = []  # KL mode, per chunk
        self.kl_values: list[tuple[list[float], list[float]]] = []  # KL mode: per-token kld, p_diff of each chunk

    # -- output -----------------------------------------------------------------------------------------

    def say(self, line: str) -> None:
        print(line, file=self.err, flush=True)

    def emit(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    # -- setup ------------------------------------------------------------------------------------------

    def tokens_and_plan(self) -> tuple[np.ndarray, ChunkPlan, str | None]:
        tok = self.engine.tokenizer
        bos = tok.bos_id if tok.add_bos else None
        text_sha = None
        tokens = None
        if self.req.text_file is not None:
            text, data = read_text(self.req.text_file)
            text_sha = hashlib.sha256(data).hexdigest()
            self.say("perplexity: tokenizing the input ..")
            t = time.perf_counter()
            tokens = tokenize_text(self.engine, text)
            self.say(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t):g} ms")
        if self.base is None:
            assert tokens is not None  # commands.py requires --file without --kl
            return tokens, plan_chunks(len(tokens), self.req.n_ctx, self.req.max_chunks, bos), text_sha
        b = self.base
        if b.n_vocab != self.n_vocab:
            raise FomoeError(f"{b.path}: vocabulary of {b.n_vocab} tokens; this model has {self.n_vocab}")
        if tokens is not None and not np.array_equal(tokens[: len(b.tokens)], b.tokens):
            raise FomoeError(f"{self.req.text_file} does not tokenize to the tokens {b.path} was computed on")
        n = b.n_chunks if self.req.max_chunks is None or self.req.max_chunks < 0 else min(b.n_chunks, self.req.max_chunks)
        if n == 0:
            raise FomoeError("--chunks 0 leaves nothing to evaluate (a negative value means all chunks)")
        return b.tokens, ChunkPlan(n_ctx=b.n_ctx, n_chunks=n, bos_id=bos), text_sha

    def identity(self, plan: ChunkPlan, tokens: np.ndarray, text_sha: str | None, top_k: int) -> dict[str, Any]:
        ident: dict[str, Any] = {  # in the order a mismatch is best reported
            "model": model_fingerprint(self.req.model),
            "text_sha256": text_sha,
            "tokens_sha256": tokens_sha256(tokens),
            "n_ctx": plan.n_ctx,
            "mode": "kl" if self.base is not None else "ppl",
            "n_batch": min(self.req.n_batch, plan.n_ctx),
            "reset_cache_per_chunk": self.req.reset_cache_per_chunk,
            # every engine option, since with CAR on even cache sizes change the numbers
            **{f"option --{k.replace('_', '-')}": v for k, v in self.req.engine_options.items()},
        }
        if self.base is not None:
            ident["text_sha256"] = None  # the tokens come from the base file
            ident["kl_base"] = hashlib.sha256(repr(sorted(self.base.header.items())).encode()).hexdigest()
        if self.req.kl_base_out is not None:
            ident["kl_base_out_top_k"] = top_k
        return ident

    def base_header(self, plan: ChunkPlan, tokens: np.ndarray, text_sha: str | None, top_k: int) -> dict[str, Any]:
        return {
            "n_ctx": plan.n_ctx,
            "n_vocab": self.n_vocab,
            "n_chunks": plan.n_chunks,
            "n_scored": plan.n_scored,
            "top_k": top_k,
            "full_rows": top_k == self.n_vocab,
            "bos_id": plan.bos_id,
            "model": model_fingerprint(self.req.model),
            "text_sha256": text_sha,
            "tokens_sha256": tokens_sha256(tokens[: plan.n_tokens_used]),
        }

    def _announce(self, tokens: np.ndarray, plan: ChunkPlan, spans: list[tuple[int, int]], resets: bool) -> None:
        what = "kl_divergence: computing" if self.base is not None else "perplexity: calculating perplexity"
        self.say(
            f"fomoe ppl: {self.req.model}: {len(tokens)} tokens, {plan.n_chunks} chunks of {plan.n_ctx}, "
            f"{plan.n_scored} scored per chunk, {len(spans)} eval call(s) of <= {spans[0][1]} tokens per chunk"
            + (f", BOS {plan.bos_id} first in every chunk" if plan.bos_id is not None else "")
        )
        self.say(f"{what} over {plan.n_chunks} chunks, n_ctx={plan.n_ctx}, batch_size={spans[0][1]}, n_seq=1")
        if resets:
            self.say("KV and expert caches reset per chunk")
        else:
            self.say(
                "KV cache reset per chunk; expert caches carried over"
                + (" (this engine has no expert-cache reset)" if self.req.reset_cache_per_chunk else "")
            )

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        tokens, plan, text_sha = self.tokens_and_plan()
        k = self.req.kl_top_k
        top_k = klm.default_top_k(self.n_vocab) if k is None else (self.n_vocab if k <= 0 else min(k, self.n_vocab))
        spans = batch_spans(plan.n_ctx, self.req.n_batch)
        reset = getattr(self.engine, "reset_expert_cache", None) if self.req.reset_cache_per_chunk else None
        self._announce(tokens, plan, spans, reset is not None)

        journal = None
        records: list[dict[str, Any]] = []
        if self.req.resume is not None:
            journal = Journal.open(self.req.resume, self.identity(plan, tokens, text_sha, top_k))
            records = journal.records[: plan.n_chunks]
            if records:
                self.say(f"fomoe ppl: {self.req.resume}: {len(records)} of {plan.n_chunks} chunks already done")
        writer = None
        if self.req.kl_base_out is not None:
            header = self.base_header(plan, tokens, text_sha, top_k)
            writer = KlBaseWriter(self.req.kl_base_out, header, tokens[: plan.n_tokens_used], n_done=len(records))
            self.say(
                f"fomoe ppl: saving the log-probs of the scored positions to {self.req.kl_base_out} "
                + ("(full rows)" if top_k == self.n_vocab else f"(top {top_k} of {self.n_vocab} tokens + tail mass)")
            )

        try:
            self._loop(tokens, plan, spans, records, reset, journal, writer, top_k)
        finally:
            for f in (writer, journal):
                if f is not None:
                    f.close()
        return 0

    def _loop(
        self,
        tokens: np.ndarray,
        plan: ChunkPlan,
        spans: list[tuple[int, int]],
        records: list[dict[str, Any]],
        reset: Callable[[], Any] | None,
        journal: Journal | None,
        writer: KlBaseWriter | None,
        top_k: int,
    ) -> None:
        step = self._kl_step if self.base is not None else self._ppl_step
        what = "kl_divergence" if self.base is not None else "perplexity"
        t_run = time.perf_counter()
        # a batch size of 1 (llama-perplexity's -b 1) is token-by-token decoding, with its prefetch
        phase = Phase.DECODE if self.req.n_batch == 1 else Phase.PREFILL
        for i in range(plan.n_chunks):
            if i < len(records):
                step(i, records[i])  # replayed: printed as when it was evaluated
                continue
            if reset is not None:
                reset()
            t = time.perf_counter()
            logits = scored_logits(self.engine, plan.eval_tokens(tokens, i), spans, plan, phase)
            dt = time.perf_counter() - t
            self.eval_seconds += dt
            self.n_evaluated += 1
            if self.n_evaluated == 1:
                self.say(
                    f"{what}: {dt:.2f} seconds per pass - ETA {int(dt * (plan.n_chunks - i)) / 60.0:.2f} minutes"
                )
            record, rows = self._compute(i, logits, plan.targets(tokens, i), top_k, writer is not None)
            if writer is not None and rows is not None:
                writer.append(rows)  # before the journal line that says chunk i is done
            if journal is not None:
                journal.append(record)
            step(i, record)
        if self.base is not None:
            self._kl_finish()
        else:
            self._ppl_finish()
        self._report(plan, time.perf_counter() - t_run)

    def _compute(
        self, i: int, logits: np.ndarray, targets: np.ndarray, top_k: int, keep_rows: bool
    ) -> tuple[dict[str, Any], klm.BaseRows | None]:
        """Chunk i's journal record, and (keep_rows) the base rows to save."""
        blocks = _blocks(len(targets), self.n_vocab)
        if self.base is not None:
            base = self.base.rows(i)
            parts = []
            for b in blocks:
                ids = None if base.ids is None else base.ids[b]
                rows = klm.BaseRows(ids, base.logp[b], base.log_tail[b], base.nll[b])
                parts.append(klm.compare(logits[b], targets[b], rows))
            t = _concat_tokens(parts)
            sums = klm.KlSums.of(t)
            return {"chunk": i, **asdict(sums), "kld": t.kld.tolist(), "p_diff": t.p_diff.tolist()}, None
        if keep_rows:
            rows = _concat_rows([klm.base_rows(logits[b], targets[b], top_k) for b in blocks])
            nll = rows.nll
        else:
            rows = None
            nll = np.concatenate([token_nll(logits[b], targets[b]) for b in blocks])
        c = ChunkNll.of(i, nll)
        return {"chunk": i, "count": c.count, "sum_nll": c.sum_nll, "sum_nll2": c.sum_nll2}, rows

    # -- PPL mode ---------------------------------------------------------------------------------------

    def _ppl_step(self, i: int, rec: dict[str, Any]) -> None:
        self.totals.add(ChunkNll(i, int(rec["count"]), float(rec["sum_nll"]), float(rec["sum_nll2"])))
        self.emit(format_running(i + 1, self.totals.estimate().ppl))

    def _ppl_finish(self) -> None:
        est = self.totals.estimate()
        self.emit("\n")
        if math.isnan(est.err):  # llama-perplexity prints this instead of its estimate; we print both
            self.say("Unexpected negative standard deviation of log(prob)")
        self.emit(format_final(est) + "\n")

    # -- KL mode ----------------------------------------------------------------------------------------

    def _kl_step(self, i: int, rec: dict[str, Any]) -> None:
        if i == 0:
            self.emit(klm.TABLE_HEADER + "\n")
        self.kl_sums.append(klm.KlSums(**{f: rec[f] for f in klm.KlSums.__dataclass_fields__}))
        self.kl_values.append((rec["kld"], rec["p_diff"]))
        self.emit(klm.format_row(i + 1, klm.KlReport.of(klm.KlSums.total(self.kl_sums))) + "\n")

    def _kl_finish(self) -> None:
        kld = np.concatenate([np.asarray(k, dtype=np.float64) for k, _ in self.kl_values])
        p_diff = np.concatenate([np.asarray(p, dtype=np.float64) for _, p in self.kl_values])
        lines = klm.format_summary(klm.KlSums.total(self.kl_sums), kld, p_diff)
        self.emit("\n" + "\n".join(lines) + "\n")

    # -- closing report ---------------------------------------------------------------------------------

    def _report(self, plan: ChunkPlan, wall: float) -> None:
        if self.n_evaluated:
            n_tok = self.n_evaluated * plan.n_ctx
            self.say(
                f"fomoe ppl: evaluated {self.n_evaluated} chunks ({n_tok} tokens) in {self.eval_seconds:.2f} s, "
                f"{n_tok / self.eval_seconds:.1f} tok/s; {wall:.2f} s in all"
            )
        # The engine's cache / CAR counters, if it keeps any: its own lines, else what stats() returns.
        lines: Callable[[], list[str]] | None = getattr(self.engine, "stats_lines", None)
        stats: Callable[[], Any] | None = getattr(self.engine, "stats", None)
        if callable(lines):
            for line in lines():
                self.say(f"fomoe ppl: {line}")
        elif callable(stats):
            result = stats()
            if isinstance(result, Mapping):
                for key, value in result.items():
                    self.say(f"fomoe ppl: {key}: {value}")
            elif result is not None:
                self.say(f"fomoe ppl: engine stats: {result}")
