"""Router selection: a decode step's one-row path is the many-row path, bit for bit; a prediction's top ids
are the experts the full routing picks."""

from __future__ import annotations

import numpy as np
import pytest

from fomoepy.experts.routing import softmax_route, softmax_route_rows, top_ids


def _logits(rng: np.random.Generator, rows: int, n_expert: int, dtype) -> np.ndarray:
    """Logits at scales from flat to peaked, with tied values (ties go to the lower expert id)."""
    z = rng.standard_normal((rows, n_expert)) * rng.uniform(0.05, 40.0, size=(rows, 1))
    for r in range(0, rows, 3):
        z[r, rng.integers(n_expert, size=4)] = z[r, 1]
    return z.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_expert,k", [(64, 8), (128, 8), (8, 8), (512, 10)])
def test_one_row_routes_as_a_row_of_many_bit_for_bit(dtype, n_expert, k):
    rng = np.random.default_rng(n_expert + k)
    batch = _logits(rng, 48, n_expert, dtype)
    many = softmax_route_rows(batch, k)
    for t in range(batch.shape[0]):
        one = softmax_route(batch[t : t + 1], k)
        assert one.ids.shape == (1, k) and one.weights.shape == (1, k) and one.probs.shape == (1, n_expert)
        assert one.weights.dtype == np.float32 and one.probs.dtype == np.float32
        assert one.ids.tobytes() == many.ids[t : t + 1].tobytes()
        assert one.weights.tobytes() == many.weights[t : t + 1].tobytes()
        assert one.probs.tobytes() == many.probs[t : t + 1].tobytes()


def test_ties_go_to_the_lower_expert_id_on_the_one_row_path():
    logits = np.zeros((1, 16), np.float32)
    logits[0, [3, 9, 12]] = 1.0
    assert softmax_route(logits, 4).ids.tolist() == [[3, 9, 12, 0]]


@pytest.mark.parametrize("n_expert,k", [(64, 8), (32, 4), (512, 10)])
def test_a_predictions_top_ids_are_the_experts_the_routing_picks_in_its_order(n_expert, k):
    # softmax is monotonic, so the largest logits are the most probable experts, in the same order, ties to
    # the lower id (at scales where float32's exp keeps distinct logits distinct: far below the top, where
    # it rounds them to one probability, the full routing's pick among them is by id, the logits' by size)
    rng = np.random.default_rng(n_expert)
    z = rng.standard_normal((96, n_expert)) * rng.uniform(0.05, 3.0, size=(96, 1))
    for r in range(0, 96, 3):  # tied logits
        z[r, rng.integers(n_expert, size=4)] = z[r, 0]
    z = z.astype(np.float32)
    assert top_ids(z, k).tolist() == softmax_route_rows(z, k).ids.tolist()
    assert top_ids(z[:1], k).tolist() == softmax_route(z[:1], k).ids.tolist()
