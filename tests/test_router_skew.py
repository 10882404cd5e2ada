"""make_test_model's router_skew and fomoepy.devtools.router_skew: the skew reaches the model's routing."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from fomoepy.devtools import make_test_model as mtm
from fomoepy.devtools import router_skew as rs

N_EXPERT, N_USED = 16, 4  # the tiny-qwen3moe preset's


def test_usage_curve_arithmetic():
    counts = np.array([[0, 10, 30, 0], [5, 5, 5, 5]])
    assert rs.usage_curves(counts).tolist() == [[3.0, 1.0, 0.0, 0.0], [1.0] * 4]
    curve = np.array([3.0, 1.0, 0.0, 0.0])
    assert rs.top_share(curve, 0.25) == pytest.approx(0.75)
    assert rs.top_share(curve, 0.125) == pytest.approx(0.375)  # half of the top expert
    assert rs.resample(curve, 8).tolist() == pytest.approx([3, 3, 1, 1, 0, 0, 0, 0])


@pytest.fixture(scope="module")
def target() -> np.ndarray:
    """A reachable skew: the top quarter of the experts takes 42% of the selections (uniform: 25%)."""
    curve = 0.9 ** np.arange(N_EXPERT)
    return curve / curve.mean()


def test_calibrated_scales_give_the_target_on_gaussian_logits(target):
    scales = rs.row_scales(target, N_USED, tokens=5000, iterations=100)
    achieved = rs.gaussian_curve(scales, N_USED)
    for f in rs.FRACTIONS:
        assert rs.top_share(achieved, f) == pytest.approx(rs.top_share(target, f), abs=0.01)


def test_skew_only_changes_the_routers(tmp_path):
    skew = tuple(np.linspace(2.0, 0.5, N_EXPERT))
    plain = GGUFReader(mtm.make_model(tmp_path / "plain.gguf", preset="tiny-qwen3moe").path)
    skewed = GGUFReader(mtm.make_model(tmp_path / "skewed.gguf", preset="tiny-qwen3moe", router_skew=skew).path)
    for a, b in zip(plain.tensors, skewed.tensors, strict=True):
        if "ffn_gate_inp" not in a.name:
            assert a.data.tobytes() == b.data.tobytes(), a.name
            continue
        ratio = np.linalg.norm(b.data, axis=1) / np.linalg.norm(a.data, axis=1)
        assert sorted(np.round(ratio, 4), reverse=True) == pytest.approx(skew, abs=1e-4), a.name


def test_skewed_routers_reach_the_target_usage_in_the_model(target, tmp_path):
    """Fails when the skew is not applied: the generator's own routers give the top quarter ~32%."""
    scales = tuple(float(f"{x:.4g}") for x in rs.row_scales(target, N_USED, tokens=5000, iterations=100))
    tokens = [np.random.default_rng(i).integers(0, 512, size=64).tolist() for i in range(4)]

    def top_quarter(**fields) -> float:
        path = mtm.make_model(tmp_path / "m.gguf", preset="tiny-qwen3moe", n_layer=4, **fields).path
        return rs.top_share(rs.mean_curve(rs.model_counts(path, tokens, threads=1).sum(axis=0)), 0.25)

    wanted = rs.top_share(target, 0.25)
    bound = (0.25 + wanted) / 2  # halfway between uniform and the target
    skewed, plain = top_quarter(router_skew=scales), top_quarter()
    assert skewed == pytest.approx(wanted, abs=0.05)
    assert skewed > bound > plain


def test_router_skew_needs_one_positive_scale_per_expert():
    with pytest.raises(ValueError, match="router_skew"):
        mtm.make_spec("tiny-qwen3moe", router_skew=(1.0, 2.0))
    with pytest.raises(ValueError, match="router_skew"):
        mtm.make_spec("tiny-qwen3moe", router_skew=(0.0,) * N_EXPERT)


def test_calibration_on_the_model_moves_its_skew_to_the_target(target, tmp_path):
    """Routers twice as spread as the Gaussian calibration says: rounds on the model bring the held-out
    usage back towards the target."""
    scales = rs.row_scales(target, N_USED, tokens=5000, iterations=100) ** 2
    path = mtm.make_model(tmp_path / "m.gguf", preset="tiny-qwen3moe", n_layer=4, router_skew=tuple(scales)).path

    def tokens(seed: int) -> list[list[int]]:
        return [np.random.default_rng([seed, i]).integers(0, 512, size=64).tolist() for i in range(8)]

    def top_quarter() -> float:
        return rs.top_share(rs.mean_curve(rs.model_counts(path, tokens(0), threads=1).sum(axis=0)), 0.25)

    wanted, before = rs.top_share(target, 0.25), top_quarter()
    measured = rs.calibrate_in_model(path, target, [tokens(1), tokens(2), tokens(3)], threads=1)
    after = top_quarter()
    assert len(measured) == 3
    assert abs(after - wanted) < abs(before - wanted) / 2, (before, after, wanted)
