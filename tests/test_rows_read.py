"""A pass whose caller reads the logits of some rows only (a prompt's last token, a perplexity chunk's
second half) computes the last layer's MoE half for those rows only, as llama.cpp does: the mixer still
takes every row (the KV cache and DeltaNet state need them), and every row is still routed and counted."""

from __future__ import annotations

import numpy as np
import pytest

from fomoepy.engine import Engine, EngineOptions
from conftest import ORACLE
from float32_bounds import reorder_bound

MODELS = ["qwen3moe_q4_k_m", "qwen35moe_q4_k"]


def computed_rows(engine: Engine) -> list[tuple[int, int]]:
    """(layer, rows) of every product the engine's expert device computes, in order."""
    calls: list[tuple[int, int]] = []
    device = engine.experts.device
    real = device.compute

    def compute(layer, h, *args):
        calls.append((layer, h.shape[0]))
        return real(layer, h, *args)

    device.compute = compute
    return calls


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", MODELS)
def test_the_last_layer_computes_its_experts_for_the_rows_read_only(name, backend):
    tokens = np.load(ORACLE / f"{name}.tokens.npy")[:12]
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=backend, threads=1))
    n_layer, n = engine.spec.n_layer, len(tokens)
    calls = computed_rows(engine)
    engine.eval(engine.new_state(), tokens)  # the last token's logits
    assert calls == [(il, n) for il in range(n_layer - 1)] + [(n_layer - 1, 1)]
    calls.clear()
    engine.eval(engine.new_state(), tokens, all_logits=True, logits_from=5)  # a perplexity chunk's scored half
    assert calls == [(il, n) for il in range(n_layer - 1)] + [(n_layer - 1, n - 5)]
    calls.clear()
    engine.eval(engine.new_state(), tokens, all_logits=True)
    assert calls == [(il, n) for il in range(n_layer)]
    engine.close()


@pytest.mark.parametrize("name", MODELS)
def test_every_row_of_the_last_layer_is_still_routed_and_counted(name):
    # usage counts, the trace and `fomoe profile` count the router's choice of every token
    tokens = np.load(ORACLE / f"{name}.tokens.npy")[:12]
    counts = []
    for all_logits in (False, True):
        engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="reference"))
        engine.eval(engine.new_state(), tokens, all_logits=all_logits)
        counter = engine.experts.streamer.counter
        counts.append((counter.counts.copy(), counter.tokens.copy()))
        engine.close()
    assert np.array_equal(counts[0][0], counts[1][0])
    assert counts[0][1].tolist() == [len(tokens)] * engine.spec.n_layer


@pytest.mark.parametrize("repack", ["off", "on"])
@pytest.mark.parametrize("name", MODELS)
def test_the_rows_read_get_the_logits_of_the_whole_pass(name, repack):
    # the same function of the same inputs: only the last layer's expert products may sum in another
    # order (ggml's graph for one row is not its graph for twelve), so the float32 reorder bound holds
    tokens = np.load(ORACLE / f"{name}.tokens.npy")[:12]
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=1, repack_experts=repack))
    whole = engine.eval(engine.new_state(), tokens, all_logits=True)
    last = engine.eval(engine.new_state(), tokens)
    tail = engine.eval(engine.new_state(), tokens, all_logits=True, logits_from=7)
    assert last.shape == (1, whole.shape[1]) and tail.shape == (len(tokens) - 7, whole.shape[1])
    bound = reorder_bound(engine.spec, len(tokens)) * np.abs(whole).max()
    assert np.abs(last[0] - whole[-1]).max() <= bound
    assert np.abs(tail - whole[7:]).max() <= bound
    engine.close()
