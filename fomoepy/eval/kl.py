"""KL divergence of a run against a base run, on arrays, with llama-perplexity's `--kl-divergence` report.

The base keeps, per scored position s, its top-K tokens (K = every token, or fewer for large vocabularies):

    ids[s, :K]   int32    the K most probable tokens, most probable first (ties: lower id first);
                          absent (None) for full rows, which hold every token in id order
    logp[s, :K]  float32  their log-probabilities (float64 log-softmax, rounded)
    log_tail[s]  float64  log of the probability outside those K (-inf for full rows)
    nll[s]       float64  -log p(target)

KL(P_base || Q) is computed over the K + 1 outcomes "each top-K token" and "any other token":

    kld = sum_k p_k (logp_k - logq_k) + p_tail (log_tail_p - log_tail_q)

exact when K = V, otherwise a lower bound of the full KL (grouping outcomes never increases a KL divergence)
that misses only how the two models differ inside the base's tail. Q's log-probs are rounded to float32 like
the stored ones before the difference, so a run compared with its own base gives exactly 0. llama.cpp instead
stores every log-prob quantised to 16 bits over a 16-nat range and drops tokens below e^-16 from the sum.

Statistics and their printed form follow llama.cpp (`kl_divergence()`): Δp = p(target) - p_base(target),
"Same top p" = share of positions where both models' most probable token is the same. Two differences: NLLs
are float64 (llama.cpp: float), and the summary is printed however few positions were scored (llama.cpp prints
none below 100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from fomoepy.eval.ppl import log_softmax_parts

# Above this vocabulary size the base keeps the top DEFAULT_TOP_K tokens instead of all of them.
FULL_ROWS_MAX_VOCAB = 4096
DEFAULT_TOP_K = 256


def default_top_k(n_vocab: int) -> int:
    return n_vocab if n_vocab <= FULL_ROWS_MAX_VOCAB else DEFAULT_TOP_K


@dataclass(frozen=True)
class BaseRows:
    """The base model's view of one chunk's S scored positions (layout in the module docstring)."""

    ids: np.ndarray | None  # int32 [S, K]; None: full rows in id order (K = V)
    logp: np.ndarray  # float32 [S, K]
    log_tail: np.ndarray  # float64 [S]
    nll: np.ndarray  # float64 [S]

    @property
    def top1(self) -> np.ndarray:
        """[S]: the base's most probable token (the lowest id of equal maxima; full rows: of the float32 values)."""
        return np.argmax(self.logp, axis=1) if self.ids is None else self.ids[:, 0]


def _log_tail(lq: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float64 [S]: log of the probability of the tokens not in ids."""
    rest = lq.copy()
    np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=1)
    m = rest.max(axis=1)
    return m + np.log(np.exp(rest - m[:, None]).sum(axis=1))


def top_k_ids(lq: np.ndarray, k: int) -> np.ndarray:
    """int64 [S, k]: the k largest of each row, largest first, equal values by ascending id."""
    part = np.sort(np.argpartition(-lq, k - 1, axis=1)[:, :k], axis=1)  # ascending id: ties stay in id order
    vals = np.take_along_axis(lq, part, axis=1)
    return np.take_along_axis(part, np.argsort(-vals, axis=1, kind="stable"), axis=1)


def base_rows(logits: np.ndarray, targets: np.ndarray, top_k: int) -> BaseRows:
    """float32 logits [S, V] of the scored positions and their targets [S] → what the base file keeps.

    top_k <= 0 or >= V keeps full rows.
    """
    z, lse = log_softmax_parts(logits)
    lq = z - lse[:, None]  # [S, V]
    nll = lse - z[np.arange(len(targets)), targets]
    if top_k <= 0 or top_k >= lq.shape[1]:
        return BaseRows(None, lq.astype(np.float32), np.full(len(lq), -np.inf), nll)
    ids = top_k_ids(lq, top_k)  # [S, K]
    return BaseRows(ids.astype(np.int32), np.take_along_axis(lq, ids, axis=1).astype(np.float32), _log_tail(lq, ids), nll)


@dataclass(frozen=True)
class KlTokens:
    """Per scored position of one chunk, float64 [S] each (same_top: bool [S])."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray


def compare(logits: np.ndarray, targets: np.ndarray, base: BaseRows) -> KlTokens:
    """This run's float32 logits [S, V] against the base's rows for the same positions."""
    z, lse = log_softmax_parts(logits)
    lq = z - lse[:, None]  # [S, V]
    if base.ids is None:
        lq_k32 = lq.astype(np.float32)  # rounded like base.logp
        top1 = np.argmax(lq_k32, axis=1)  # from rounded values, as base.top1
    else:
        lq_k32 = np.take_along_axis(lq, base.ids.astype(np.int64), axis=1).astype(np.float32)
        top1 = np.argmax(z, axis=1)
    lp_k = base.logp.astype(np.float64)
    kld = (np.exp(lp_k) * (lp_k - lq_k32.astype(np.float64))).sum(axis=1)
    if base.ids is not None:
        tail = np.exp(base.log_tail) * (base.log_tail - _log_tail(lq, base.ids))
        kld = kld + np.where(np.isfinite(base.log_tail), tail, 0.0)
    nll = lse - z[np.arange(len(targets)), targets]
    return KlTokens(
        nll=nll,
        nll_base=base.nll.astype(np.float64),
        kld=kld,
        p_diff=np.exp(-nll) - np.exp(-base.nll),
        same_top=top1 == base.top1,
    )


@dataclass(frozen=True)
class KlSums:
    """The sums llama.cpp keeps (kl_divergence_result); per chunk exactly rounded, added over chunks."""

    count: int = 0
    n_same_top: int = 0
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0

    @classmethod
    def of(cls, t: KlTokens) -> KlSums:
        def s(x: np.ndarray) -> float:
            return math.fsum(np.asarray(x, dtype=np.float64).tolist())

        pd2 = t.p_diff * t.p_diff
        return cls(
            count=int(t.nll.size),
            n_same_top=int(np.count_nonzero(t.same_top)),
            sum_nll=s(t.nll),
            sum_nll2=s(t.nll * t.nll),
            sum_nll_base=s(t.nll_base),
            sum_nll_base2=s(t.nll_base * t.nll_base),
            sum_nll_nll_base=s(t.nll * t.nll_base),
            sum_kld=s(t.kld),
            sum_kld2=s(t.kld * t.kld),
            sum_p_diff=s(t.p_diff),
            sum_p_diff2=s(pd2),
            sum_p_diff4=s(pd2 * pd2),
        )

    @classmethod
    def total(cls, parts: list[KlSums]) -> KlSums:
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = sum(values) if f.type in ("int", int) else math.fsum(values)
        return cls(**out)


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's: the mean and the standard error of the mean (0 for 10 values or fewer)."""
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def covariance(suma: float, sumb: float, sumab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sumab / count - (suma / count) * (sumb / count)) / (count - 1)


def _sqrt_var(x: float) -> float:
    """sqrt of a variance computed as a difference, where rounding can leave a tiny negative (llama.cpp: nan)."""
    return math.sqrt(max(x, 0.0))


@dataclass(frozen=True)
class KlReport:
    """The quantities of llama.cpp's KL table and summary, from KlSums."""

    ppl: float
    ppl_unc: float
    ppl_base: float
    ppl_base_unc: float
    cor: float
    ln_ratio: float
    ln_ratio_unc: float
    kld: float
    kld_unc: float
    p_diff: float
    p_diff_unc: float
    rms_p_diff: float
    rms_p_diff_unc: float
    same_top: float
    same_top_unc: float

    @classmethod
    def of(cls, s: KlSums) -> KlReport:
        lp, lp_unc = mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
        lb, lb_unc = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
        cov = covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
        kld, kld_unc = mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
        pd, pd_unc = mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, s.count)
        mse, mse_unc = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count)
        rms = math.sqrt(mse)
        top = s.n_same_top / s.count
        with np.errstate(divide="ignore", invalid="ignore"):  # C's x/0: inf or nan, as llama.cpp prints
            cor = float(np.float64(cov) / (np.float64(lp_unc) * np.float64(lb_unc)))
        rms_unc = 0.5 / rms * mse_unc if rms > 0 else 0.0
        return cls(
            ppl=math.exp(lp),
            ppl_unc=math.exp(lp) * lp_unc,
            ppl_base=math.exp(lb),
            ppl_base_unc=math.exp(lb) * lb_unc,
            cor=cor,
            ln_ratio=lp - lb,
            ln_ratio_unc=_sqrt_var(lp_unc * lp_unc + lb_unc * lb_unc - 2.0 * cov),
            kld=kld,
            kld_unc=kld_unc,
            p_diff=pd,
            p_diff_unc=pd_unc,
            rms_p_diff=rms,
            rms_p_diff_unc=rms_unc,
            same_top=top,
            same_top_unc=math.sqrt(top * (1 - top) / (s.count - 1)) if s.count > 1 else math.nan,
        )


TABLE_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
    "            Same top p"
)


def format_row(i: int, r: KlReport) -> str:
    """llama.cpp's per-chunk line (running values after chunk i, 1-based)."""
    return (
        f"{i:4d}    {r.ppl:9.4f} ± {r.ppl_unc:9.4f}    {r.ln_ratio:10.5f} ± {r.ln_ratio_unc:10.5f}"
        f"    {r.kld:10.5f} ± {r.kld_unc:10.5f}    {100 * r.rms_p_diff:6.3f} ± {100 * r.rms_p_diff_unc:6.3f} %"
        f"    {100 * r.same_top:6.3f} ± {100 * r.same_top_unc:6.3f} %"
    )


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's: linear interpolation between the two nearest ranks."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)])


def median(sorted_values: np.ndarray) -> float:
    v, n = sorted_values, len(sorted_values)
    return float(0.5 * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2])


def format_summary(s: KlSums, kld_values: np.ndarray, p_diff_values: np.ndarray) -> list[str]:
    """llama.cpp's three summary blocks (perplexity, KL divergence, token probability)."""
    r = KlReport.of(s)
    kv, pv = np.sort(kld_values), np.sort(p_diff_values)
    ratio = math.exp(r.ln_ratio)
    cov = covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
    ppl_cov = r.ppl * r.ppl_base * cov
    out = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {r.ppl:10.6f} ± {r.ppl_unc:10.6f}",
        f"Mean PPL(base)                : {r.ppl_base:10.6f} ± {r.ppl_base_unc:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * r.cor:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {r.ln_ratio:10.6f} ± {r.ln_ratio_unc:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {ratio:10.6f} ± {ratio * r.ln_ratio_unc:10.6f}",
        (
            f"Mean PPL(Q)-PPL(base)         : {r.ppl - r.ppl_base:10.6f} ± "
            f"{_sqrt_var(r.ppl_unc**2 + r.ppl_base_unc**2 - 2.0 * ppl_cov):10.6f}"
        ),
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {r.kld:10.6f} ± {r.kld_unc:10.6f}",
        f"Maximum KLD: {kv[-1]:10.6f}",
    ]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9)):
        out.append(f"{label}   KLD: {percentile(kv, frac):10.6f}")
    out.append(f"Median  KLD: {median(kv):10.6f}")
    for label, frac in (("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        out.append(f"{label}   KLD: {percentile(kv, frac):10.6f}")
    out += [
        f"Minimum KLD: {kv[0]:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * r.p_diff:6.3f} ± {100 * r.p_diff_unc:5.3f} %",
        f"Maximum Δp: {100 * pv[-1]:6.3f}%",
    ]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("75.0%", 0.75)):
        out.append(f"{label}   Δp: {100 * percentile(pv, frac):6.3f}%")
    out.append(f"Median  Δp: {100 * median(pv):6.3f}%")
    for label, frac in (("25.0%", 0.25), ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        out.append(f"{label}   Δp: {100 * percentile(pv, frac):6.3f}%")
    out += [
        f"Minimum Δp: {100 * pv[0]:6.3f}%",
        f"RMS Δp    : {100 * r.rms_p_diff:6.3f} ± {100 * r.rms_p_diff_unc:5.3f} %",
        f"Same top p: {100 * r.same_top:6.3f} ± {100 * r.same_top_unc:5.3f} %",
    ]
    return out
