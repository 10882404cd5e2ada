"""Rung 2 of the correctness ladder: the numpy forward pass against llama.cpp's and the exact logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ORACLE, open_oracle_engine
from float32_bounds import reorder_bound

from fomoepy.experts.device import Phase

MODELS = sorted(json.loads((ORACLE / "MANIFEST.json").read_text())["models"])


@pytest.fixture(scope="module", params=MODELS)
def run(request):
    name = request.param
    engine = open_oracle_engine(name)
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    return name, engine, tokens, engine.logits(tokens)


def test_logits_within_1e3_std_of_exact(run):
    name, _, _, logits = run
    exact = np.load(ORACLE / f"{name}.exact.npy")
    assert logits.shape == exact.shape
    err = np.abs(logits - exact).max() / exact.std()
    assert err <= 1e-3, f"{name}: max |ours - exact| = {err:.2e} x std"


def test_strict_models_match_llamacpp_and_others_agree_on_argmax(run, manifest):
    name, _, _, logits = run
    info = manifest["models"][name]
    exact = np.load(ORACLE / f"{name}.exact.npy")
    llama = np.load(ORACLE / f"{name}.llamacpp.npy")
    if info["strict"]:
        assert np.abs(logits - llama).max() <= 1e-3 * exact.std()
    agreement = np.mean(logits.argmax(-1) == llama.argmax(-1))
    assert agreement >= info["argmax_agreement"], f"{name}: argmax agreement {agreement:.3f}"


def test_prefill_equals_token_by_token_decode(run):
    name, engine, tokens, logits = run
    state = engine.new_state()
    stepped = np.concatenate([engine.eval(state, tokens[i : i + 1], all_logits=True, phase=Phase.DECODE) for i in range(len(tokens))])
    rel = np.abs(stepped - logits).max() / np.abs(logits).max()
    bound = reorder_bound(engine.spec, len(tokens))  # only the order of float32 sums differs
    assert rel <= bound, f"{name}: prefill vs decode differ by {rel:.2e} of the largest logit (bound {bound:.2e})"


def test_prefill_in_uneven_chunks_equals_one_batch(run):
    name, engine, tokens, logits = run
    state = engine.new_state()
    cuts = [0, 3, 4, 17, len(tokens)]
    parts = [engine.eval(state, tokens[a:b], all_logits=True) for a, b in zip(cuts, cuts[1:])]
    rel = np.abs(np.concatenate(parts) - logits).max() / np.abs(logits).max()
    bound = reorder_bound(engine.spec, len(tokens))
    assert rel <= bound, f"{name}: uneven chunks vs one batch differ by {rel:.2e} of the largest logit (bound {bound:.2e})"


@pytest.mark.parametrize("token", [-1, "vocab"])
def test_a_token_outside_the_vocabulary_is_refused_before_the_state_changes(run, token):
    _, engine, tokens, _ = run
    state = engine.new_state()
    engine.eval(state, tokens[:2])
    bad = engine.spec.n_vocab if token == "vocab" else token
    for step in ([bad], [int(tokens[2]), bad]):  # a decode step's one token, and a prompt's
        with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary"):
            engine.eval(state, step)
    assert state.n_past == 2 and state.tokens == [int(t) for t in tokens[:2]]
