"""Expert-usage skew: measure it on a model, and give a random test model's routers a measured one.

A usage curve is one layer's expert selection counts sorted in descending order and normalised to mean 1
(all ones: uniform routing; at most n_expert / n_expert_used, an expert every token picks). Curves of
models with different expert counts are compared at the same fractions of their experts: `top_share`
reads the share of all selections taken by the most used fraction, `resample` redraws a curve for
another expert count with the same cumulative shares.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

FRACTIONS = (0.10, 0.25, 0.50)  # of the experts, most used first: the shares printed side by side


def usage_curves(counts: np.ndarray) -> np.ndarray:
    """[n_layer, n_expert] selection counts -> each layer's usage curve (descending, mean 1)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=1, keepdims=True)
    return -np.sort(-counts, axis=1) / np.maximum(total, 1) * counts.shape[1]


def mean_curve(counts: np.ndarray) -> np.ndarray:
    """The layers' usage curves averaged rank by rank (the skew of a typical layer, whichever experts)."""
    return usage_curves(counts).mean(axis=0)


def _cumulative(curve: np.ndarray) -> np.ndarray:
    """Share of selections taken by the top 0, 1, .., n experts."""
    return np.concatenate([[0.0], np.cumsum(curve) / np.sum(curve)])


def top_share(curve: np.ndarray, fraction: float) -> float:
    """Share of selections taken by the most used `fraction` of the experts, the cumulative share
    interpolated linearly between whole experts (10% of 32 experts is 3.2 of them)."""
    n = len(curve)
    return float(np.interp(fraction * n, np.arange(n + 1), _cumulative(curve)))


def resample(curve: np.ndarray, n_expert: int) -> np.ndarray:
    """The usage curve of `n_expert` experts whose cumulative shares equal `curve`'s at the same fractions."""
    n = len(curve)
    at = np.interp(np.arange(n_expert + 1) / n_expert * n, np.arange(n + 1), _cumulative(curve))
    return np.diff(at) * n_expert


def shares_line(curve: np.ndarray) -> str:
    """'top 10% 21.7%, top 25% 42.8%, top 50% 70.5%; most used expert 2.61x the mean, least 0.05x'."""
    shares = ", ".join(f"top {f:.0%} {top_share(curve, f):.1%}" for f in FRACTIONS)
    return f"{shares}; most used expert {curve[0]:.2f}x the mean, least {curve[-1]:.2f}x"


def row_scales(target: np.ndarray, n_used: int, tokens: int = 20000, iterations: int = 200, seed: int = 0) -> np.ndarray:
    """Router row scales, most used first, whose top-`n_used` choices follow the usage curve `target`.

    Why this model of the router: a random test model's router input (the normalised hidden state) has
    nearly no preferred direction and its router rows are independent Gaussian vectors, so a token's
    router logits are close to independent Gaussians, each with its row's norm as spread. Scaling row e
    by s_e scales that spread: wider-spread experts reach the top k more often, and never always (at
    most when their logit is positive, half the tokens; curves that need more are out of reach).
    Calibrating on such logits drawn here takes a second, where each round on the model runs it over
    thousands of tokens; `calibrate_in_model` then corrects what the model's deeper layers do otherwise.

    Fixed-point iteration on the same draws: s_e <- s_e * sqrt(target_e / usage_e) (each step within
    0.8..1.25), then scaled to RMS 1 (top-k choices do not depend on a common factor; the router keeps
    its overall spread)."""
    target = np.asarray(target, dtype=np.float64)
    n_expert = len(target)
    z = np.random.default_rng(seed).standard_normal((tokens, n_expert))
    scales = np.ones(n_expert)
    for _ in range(iterations):
        usage = _gaussian_usage(z * scales, n_used)
        # bounded steps: an expert the draws never pick (usage 0) would otherwise jump past its target
        scales *= np.clip(np.sqrt(target / np.maximum(usage, 1e-9)), 0.8, 1.25)
        scales /= np.sqrt(np.mean(scales**2))
    return scales


def _gaussian_usage(logits: np.ndarray, n_used: int) -> np.ndarray:
    """Per expert, in the given order: usage (mean 1) of top-`n_used` choices over the rows of `logits`."""
    top = np.argpartition(-logits, n_used - 1, axis=1)[:, :n_used]
    counts = np.bincount(top.reshape(-1), minlength=logits.shape[1])
    return counts / counts.sum() * logits.shape[1]


def gaussian_curve(scales: np.ndarray, n_used: int, tokens: int = 20000, seed: int = 1) -> np.ndarray:
    """The usage curve `scales` give on fresh Gaussian logits (how well the calibration converged)."""
    z = np.random.default_rng(seed).standard_normal((tokens, len(scales)))
    return -np.sort(-_gaussian_usage(z * scales, n_used))


def model_counts(
    model: str | os.PathLike[str], sequences: Iterable[Sequence[int]], piece: int | None = None, threads: int | None = None
) -> np.ndarray:
    """[n_pieces, n_layer, n_expert]: the router's choices in each piece of `piece` tokens (whole
    sequences if None), every sequence from an empty context, its pieces evaluated one after another
    (cpu backend, experts read from the GGUF)."""
    from fomoepy.engine import Engine, EngineOptions

    engine = Engine(model, EngineOptions(backend="cpu", threads=threads))
    counter = engine.experts.streamer.counter
    pieces = []
    try:
        for tokens in sequences:
            state, tokens = engine.new_state(), list(tokens)
            step = piece or len(tokens)
            for start in range(0, len(tokens), step):
                before = counter.counts.copy()
                engine.eval(state, tokens[start : start + step])
                pieces.append(counter.counts - before)
        return np.array(pieces)
    finally:
        engine.close()


def demo_sequences() -> tuple[str, list[list[int]]]:
    """The demo model and its held-out text (text it never saw in training) as token ids, in windows of
    its context length."""
    from fomoepy.data import demo_heldout_path, demo_model_path
    from fomoepy.model.gguf_file import GGUFFile
    from fomoepy.model.spec import ModelSpec
    from fomoepy.model.tokenizer import Tokenizer

    model = demo_model_path()
    ids = Tokenizer.from_gguf(model).encode(demo_heldout_path().read_text(encoding="utf-8"))
    n_ctx = ModelSpec.from_gguf(GGUFFile(model)).context_length
    return str(model), [ids[s : s + n_ctx] for s in range(0, len(ids), n_ctx)]


def calibrate_in_model(
    model: str | os.PathLike[str], target: np.ndarray, rounds: Sequence[Sequence[Sequence[int]]], threads: int | None = None
) -> list[np.ndarray]:
    """Widen or narrow each layer's spread of router row scales in place, one round per entry of
    `rounds` (token sequences, each from an empty context), until the layer's usage curve has the
    target's skew; returns the usage curve (mean over layers) each round measured before it adjusted.

    Why on the model too: `row_scales` assumes router logits that are independent Gaussians. In a random
    model's deeper layers the hidden states fill fewer directions, the experts' logits are correlated,
    and the same scales give more skew than on Gaussian logits (bench shape, 9 layers: the last two
    take 50% of selections in their top quarter of experts where the target has 43%). Matching each
    row's measured logit spread, or stepping each expert's scale by its own usage, left that excess
    (the first) or added sampling noise to the scales, which is skew too (the second). So each round
    measures one number per layer, its skew: the top 10/25/50% shares' excess over uniform routing,
    summed; and multiplies the layer's log row norms (about their mean) by target skew / measured
    skew, within 0.5..1.5: the experts keep their ranks, the layer's curve moves towards the target's
    (skew grows more slowly than the spread of log norms, so the step does not overshoot). Rounds should use tokens other than those the result is
    judged on."""
    from gguf import GGUFReader

    def skew(curve: np.ndarray) -> float:
        return sum(top_share(curve, f) - f for f in FRACTIONS)

    wanted = skew(np.asarray(target, dtype=np.float64))
    measured = []
    for sequences in rounds:
        counts = model_counts(model, sequences, threads=threads).sum(axis=0)
        measured.append(mean_curve(counts))
        curves = usage_curves(counts)
        for tensor in GGUFReader(model, "r+").tensors:
            if "ffn_gate_inp" not in tensor.name:
                continue
            layer = int(tensor.name.split(".")[1])  # blk.{layer}.ffn_gate_inp.weight
            rows = tensor.data  # [n_expert, n_embd] float32, mapped from the file
            power = float(np.clip(wanted / max(skew(curves[layer]), 1e-6), 0.5, 1.5))
            log_norm = np.log(np.linalg.norm(rows, axis=1))
            rows *= np.exp((power - 1) * (log_norm - log_norm.mean())).astype(np.float32)[:, None]
            rows.flush()
    return measured
