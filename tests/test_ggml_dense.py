"""The cpu backend's RMS norm and a decode row's two attention-layer graphs (fomoepy.runtime.ggml_dense):
the norm against float64, row by row; the graphs against the op-by-op path, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from float32_bounds import U

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.device import Phase
from fomoepy.runtime.ggml_dense import rms_norm_rows

F32 = np.float32


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_rows_is_x_over_its_rms_and_each_row_its_own(threads):
    # ggml sums x² in double (exact to far below float32 here), then rounds: the mean to float32 (u),
    # its sum with eps (u), the square root (u, and half its input's u), the reciprocal (u) and the
    # product with x (u): at most 5.5u of the exact value, relatively
    rng = np.random.default_rng(1)
    eps = 1e-6
    x = (rng.standard_normal((7, 3, 256)) * rng.uniform(0.01, 100, size=(7, 3, 1))).astype(F32)
    got = rms_norm_rows(x, eps, threads)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(F32(eps)))
    assert got.shape == x.shape and got.dtype == F32
    assert np.all(np.abs(got - want) <= 5.5 * U * np.abs(want))
    for i in (0, 4):  # a row alone: the bits it gets among the others
        assert np.array_equal(rms_norm_rows(x[i, 1], eps, threads), got[i, 1])
    assert not np.array_equal(rms_norm_rows(x, 1.0, threads), got)  # eps is the graph's, not a cached one's


@pytest.mark.parametrize("name", ["qwen3moe_q4_k_m", "qwen3moe_q6_k"])
def test_a_decode_rows_graphs_give_the_op_by_op_paths_bits(name):
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    runs = []
    for fused in (True, False):
        engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2))
        assert engine.ops.fuses_attention(engine.spec.attention)
        if not fused:
            engine.ops.fuses_attention = lambda a: False
        state = engine.new_state()
        engine.eval(state, tokens[:-4])
        runs.append([engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in tokens[-4:]])
        engine.close()
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_gated_attention_keeps_the_op_by_op_path():
    engine = Engine(ORACLE / "qwen35moe_q4_k.gguf", EngineOptions(backend="cpu", threads=1))
    assert engine.spec.attention.gated and not engine.ops.fuses_attention(engine.spec.attention)
    engine.close()
