"""Cache-aware routing: substitution rule, weight contract, options, and a loop-by-loop reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fomoepy.errors import FomoeError
from fomoepy.experts.car import CarConfig, CarStats, as_mask, cache_aware_route
from fomoepy.experts.routing import softmax_route

# exact binary fractions, so probability ratios are exact: expert i has probability 2^-(i+1) (≈ for the tail)
PROBS = np.array([2.0 ** -(i + 1) for i in range(8)], dtype=np.float32)
PROBS[-1] = 1 - PROBS[:-1].sum()  # 2^-7, keeps the sum exactly 1


def route(probs, k, cached, config, layer=1, n_layer=4, first_token=0):
    probs = np.atleast_2d(probs).astype(np.float32)
    logits = np.log(probs)
    r = softmax_route(logits, k)
    ids, weights = r.ids, r.weights
    result = cache_aware_route(
        ids, weights, probs, cached, config, layer=layer, n_layer=n_layer, first_token=first_token
    )
    return ids, weights, result


def reference(ids, weights, probs, mask, config, layer, n_layer, first_token):
    """The rule as the docstring states it, one token and one slot at a time."""
    out_ids, out_w, pairs = ids.copy(), weights.copy(), []
    if not config.applies_to_layer(layer, n_layer):
        return out_ids, out_w, pairs
    for t in range(ids.shape[0]):
        if first_token + t < config.warmup_tokens:
            continue
        used = set(ids[t].tolist())
        changed = False
        for j, o in enumerate(ids[t]):
            if mask[o]:
                continue
            cands = [e for e in range(len(mask)) if mask[e] and e not in used]
            if not cands:
                continue
            s = min(cands, key=lambda e: (-probs[t, e], e))
            if float(probs[t, s]) / float(probs[t, o]) >= config.threshold:
                out_ids[t, j] = s
                used.add(s)
                pairs.append((int(o), int(s)))
                changed = True
        if changed and config.dampen:
            top = probs[t, out_ids[t]].astype(np.float32)
            out_w[t] = top / top.sum()
    return out_ids, out_w, pairs


def test_substitutes_exactly_when_the_ratio_clears_the_threshold():
    cached = {0, 2}  # selected (top-2): 0 cached, 1 not; best cached candidate: 2, ratio (1/8)/(1/4) = 0.5
    _, _, at = route(PROBS, 2, cached, CarConfig(threshold=0.5))
    assert at.ids.tolist() == [[0, 2]] and at.substitutions == [(1, 2)]
    _, _, above = route(PROBS, 2, cached, CarConfig(threshold=float(np.nextafter(0.5, 1))))
    assert above.ids.tolist() == [[0, 1]] and above.substitutions == []
    _, _, below = route(PROBS, 2, cached, CarConfig(threshold=float(np.nextafter(0.5, 0))))
    assert below.substitutions == [(1, 2)]


def test_best_cached_candidate_wins_and_a_failed_slot_leaves_it_for_the_next():
    # top-3 = 0, 1, 2, none cached; cached 4 (1/32) and 6 (1/128). Slot 0: 4/0 ratio 1/16 < 0.2;
    # slot 1 (1/4): ratio 1/8 < 0.2; slot 2 (1/8): ratio 1/4 ≥ 0.2 → 4 takes slot 2, 6 is never tried above
    _, _, r = route(PROBS, 3, {4, 6}, CarConfig(threshold=0.2))
    assert r.ids.tolist() == [[0, 1, 4]] and r.substitutions == [(2, 4)]
    _, _, r = route(PROBS, 3, {4, 6}, CarConfig(threshold=0.01))  # everything clears: best first
    assert r.ids.tolist() == [[4, 6, 2]] and r.substitutions == [(0, 4), (1, 6)]


def test_selected_cached_experts_are_never_duplicated():
    # 1 is selected and cached: it must not also substitute for 0
    _, _, r = route(PROBS, 2, {1}, CarConfig(threshold=0.01))
    assert r.ids.tolist() == [[0, 1]] and r.substitutions == []


def test_threshold_off_is_an_exact_passthrough():
    probs = np.random.default_rng(0).dirichlet(np.ones(16), size=5).astype(np.float32)
    for config in (CarConfig(), CarConfig(threshold=0), CarConfig(threshold=None, dampen=True)):
        ids, weights, r = route(probs, 4, np.ones(16, bool) & (np.arange(16) > 8), config)
        assert r.ids is ids and r.weights is weights and r.substitutions == []


def test_weights_without_dampening_are_the_exact_run_weights():
    _, weights, r = route(PROBS, 3, {4, 5}, CarConfig(threshold=0.01))
    assert r.ids.tolist() == [[4, 5, 2]]
    assert np.array_equal(r.weights, weights)


def test_dampened_weights_are_renormalised_substitute_probabilities():
    _, weights, r = route(PROBS, 3, {4, 5}, CarConfig(threshold=0.01, dampen=True))
    p = PROBS[[4, 5, 2]]
    # powers of two: the sum is exact and each side's division is correctly rounded (within u/2 of the weight)
    assert np.allclose(r.weights[0], p / p.sum(), rtol=0, atol=1e-7)
    assert r.weights.sum() == pytest.approx(1.0, abs=1e-6)
    assert r.weights[0, 2] > weights[0, 2]  # the kept expert gains weight as the substitutes are weaker


def test_warmup_leaves_the_first_tokens_alone():
    probs = np.tile(PROBS, (4, 1))
    _, _, r = route(probs, 2, {2}, CarConfig(threshold=0.3, warmup_tokens=12), first_token=10)
    assert r.ids[:, 1].tolist() == [1, 1, 2, 2]  # tokens 10, 11 are warm-up; 12, 13 substitute


def test_protected_first_and_last_layers_are_exact():
    config = CarConfig(threshold=0.1, protect_first=1, protect_last=2)
    ran = [route(PROBS, 2, {2}, config, layer=layer, n_layer=6)[2].substitutions != [] for layer in range(6)]
    assert ran == [False, True, True, True, False, False]


def test_config_is_validated_and_stats_count_the_rate():
    with pytest.raises(FomoeError, match="threshold"):
        CarConfig(threshold=-0.5)
    with pytest.raises(FomoeError, match="warmup tokens"):
        CarConfig(threshold=0.5, warmup_tokens=-1)
    stats = CarStats()
    stats.record(3, route(PROBS, 2, {2}, CarConfig(threshold=0.1))[2])
    stats.record(3, route(PROBS, 2, {1}, CarConfig(threshold=0.1))[2])
    assert (stats.slots, stats.substituted, stats.rate) == (4, 1, 0.25)
    assert stats.per_layer == {3: [4, 1]} and "25.00%" in stats.line()


def test_as_mask_accepts_sets_and_masks():
    assert as_mask({1, 3}, 4).tolist() == [False, True, False, True]
    with pytest.raises(ValueError):
        as_mask(np.zeros(3, bool), 4)


@settings(max_examples=200, deadline=None)
@given(
    logits=hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(4, 12)),
                      elements=st.floats(-4, 4, width=32)),
    k_frac=st.floats(0.1, 0.9),
    mask_seed=st.integers(0, 2**32 - 1),
    threshold=st.sampled_from([0.05, 0.2, 0.5, 0.9, 1.0]),
    dampen=st.booleans(),
    warmup=st.integers(0, 3),
    layer=st.integers(0, 3),
)
def test_matches_the_reference_and_keeps_its_promises(logits, k_frac, mask_seed, threshold, dampen, warmup, layer):
    T, E = logits.shape
    k = max(1, int(k_frac * E))
    r = softmax_route(logits, k)
    ids, weights = r.ids, r.weights
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    mask = np.random.default_rng(mask_seed).random(E) < 0.5
    config = CarConfig(threshold=threshold, dampen=dampen, warmup_tokens=warmup, protect_first=1)
    r = cache_aware_route(ids, weights, probs, mask, config, layer=layer, n_layer=4, first_token=1)
    ref_ids, ref_w, ref_pairs = reference(ids, weights, probs, mask, config, layer, 4, 1)
    assert np.array_equal(r.ids, ref_ids)
    assert r.substitutions == ref_pairs
    # both sides divide the same float32 probabilities by a float32 sum of the same k terms, perhaps added in
    # another order: the sums differ by at most 2(k-1)u of their size, the weights (<= 1) by that plus one rounding
    assert np.allclose(r.weights, ref_w, rtol=0, atol=(2 * (k - 1) + 1) * 2.0**-24)
    for t in range(T):
        assert len(set(r.ids[t].tolist())) == k  # never an expert twice
        assert r.weights[t].sum() == pytest.approx(1.0, abs=1e-5)
    changed = r.ids != ids
    assert mask[r.ids[changed]].all() and not mask[ids[changed]].any()
    unchanged_rows = ~changed.any(axis=1)
    assert np.array_equal(r.weights[unchanged_rows], weights[unchanged_rows])  # bit for bit
