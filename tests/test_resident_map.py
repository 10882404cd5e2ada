"""The device tier's slots by (layer, expert) (fomoepy/runtime/_resident_map.c's ResidentMap, GpuExperts.resident
where built): it answers what GpuExperts asks of a dict as a dict does, over a random run of sets, gets,
pops, deletions and clears, and refuses a key that is not a (layer, expert) pair."""

from __future__ import annotations

import numpy as np
import pytest

ResidentMap = pytest.importorskip("fomoepy.runtime._driver_calls").ResidentMap


def test_a_resident_map_answers_as_a_dict_does():
    rng = np.random.default_rng(3)
    m, d = ResidentMap(4), {}
    for step in range(4000):
        key = (int(rng.integers(0, 4)), int(rng.integers(0, 300)))  # (past 64 experts: a layer's array grows)
        op = rng.integers(0, 6)
        if op == 0:
            m[key] = d[key] = object()
        elif op == 1:
            assert m.get(key) is d.get(key) and m.get(key, "none") is d.get(key, "none")
        elif op == 2:
            assert m.pop(key, None) is d.pop(key, None)
        elif op == 3:
            assert (key in m) == (key in d)
            if key in d:
                assert m[key] is d[key]
                del m[key], d[key]
            else:
                with pytest.raises(KeyError):
                    m[key]
                with pytest.raises(KeyError):
                    m.pop(key)
        elif op == 4:
            assert len(m) == len(d) and sorted(m) == sorted(d) and sorted(m.keys()) == sorted(d)
        elif step % 500 == 0:
            m.clear(), d.clear()
    assert len(m) == len(d) and all(m[k] is v for k, v in d.items())


def test_a_key_is_a_layer_and_expert_pair():
    m = ResidentMap(2)
    for bad in (3, (1,), (1, 2, 3), ("a", 1)):
        with pytest.raises(TypeError):
            m.get(bad)
    assert m.get((7, 1)) is None and (-1, 0) not in m  # outside the layers: not held
    with pytest.raises(KeyError):
        m[(7, 1)] = object()
