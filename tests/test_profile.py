"""Frequency profiles: counting router choices and FOMOE's `.freq` file format."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fomoepy.errors import FomoeError
from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.profile import (
    ExpertCounter,
    FreqProfile,
    read_freq,
    seed_order,
    sorted_entries,
    write_freq,
)


def fomoe_bytes(n_layers, entries, magic=0x46524551, version=1, n_entries=None) -> bytes:
    """A .freq file built field by field from the format description, independent of our writer."""
    head = struct.pack("<IIII", magic, version, n_layers, len(entries) if n_entries is None else n_entries)
    return head + b"".join(struct.pack("<HHf", layer, expert, freq) for layer, expert, freq in entries)


def counted() -> FreqProfile:
    c = ExpertCounter(n_layer=2, n_expert=8)
    c.add(0, np.array([[1, 2], [1, 3], [1, 2], [4, 1]]))  # 4 tokens, top-2
    c.add(1, np.array([[7, 0], [7, 0], [5, 0], [7, 6]]))
    return c.profile()


def test_counts_become_fractions_of_tokens_sorted_by_frequency():
    p = counted()
    assert p.items() == [
        (0, 1, 1.0), (1, 0, 0.75), (1, 7, 0.75), (0, 2, 0.5),
        (0, 3, 0.25), (0, 4, 0.25), (1, 5, 0.25), (1, 6, 0.25),
    ]  # ties: lower layer, then lower expert
    assert seed_order(p)[:3] == [(0, 1), (1, 0), (1, 7)]


def test_decode_steps_one_token_at_a_time_count_as_the_same_tokens_in_one_step():
    rows = np.array([[1, 2], [1, 3], [1, 2], [4, 1]])
    one_by_one = ExpertCounter(n_layer=1, n_expert=8)
    for row in rows:
        one_by_one.add(0, row[None, :])  # a decode step's [1, k]
    together = ExpertCounter(n_layer=1, n_expert=8)
    together.add(0, rows)
    assert one_by_one.counts.tolist() == together.counts.tolist() and one_by_one.tokens.tolist() == [4]
    assert one_by_one.profile() == together.profile()


def test_write_matches_the_format_byte_for_byte_and_reads_back(tmp_path):
    p = counted()
    path = tmp_path / "model.freq"
    write_freq(path, p)
    assert path.read_bytes() == fomoe_bytes(2, p.items())
    assert len(path.read_bytes()) == 16 + 8 * len(p)
    assert read_freq(path, n_layer=2, n_expert=8) == p
    assert not (tmp_path / "model.freq.partial").exists()


def test_reads_a_file_written_by_another_tool_and_sorts_it(tmp_path):
    path = tmp_path / "fomoe.freq"
    path.write_bytes(fomoe_bytes(3, [(2, 9, 0.125), (0, 4, 0.5), (1, 1, 0.5)]))
    assert read_freq(path).items() == [(0, 4, 0.5), (1, 1, 0.5), (2, 9, 0.125)]


def test_an_empty_profile_round_trips(tmp_path):
    empty = ExpertCounter(4, 8).profile()
    write_freq(tmp_path / "e.freq", empty)
    assert len(read_freq(tmp_path / "e.freq")) == 0 and read_freq(tmp_path / "e.freq").n_layers == 4


@pytest.mark.parametrize(
    "data, kwargs, message",
    [
        (b"FRE", {}, "expected a 16-byte .freq header, got 3 bytes"),
        (fomoe_bytes(2, [], magic=0x47475546), {}, "not a .freq profile \\(magic 0x47475546"),
        (fomoe_bytes(2, [], version=2), {}, "expected .freq version 1, got 2"),
        (fomoe_bytes(2, [(0, 1, 0.5)], n_entries=2), {}, "truncated: 2 entries need 32 bytes, got 24"),
        (fomoe_bytes(2, [(0, 1, 0.5)]) + b"\0", {}, "trailing bytes"),
        (fomoe_bytes(2, [(0, 1, 0.5)]), {"n_layer": 3}, "profile is for 2 layers, the model has 3"),
        (fomoe_bytes(2, [(0, 1, 0.5), (2, 1, 0.25)]), {}, "entry 1 has layer 2, expected < 2"),
        (fomoe_bytes(2, [(1, 8, 0.5)]), {"n_expert": 8}, "entry 0 has expert 8, expected < 8"),
        (fomoe_bytes(2, [(1, 1, -0.5)]), {}, "frequency -0.5"),
        (fomoe_bytes(2, [(1, 1, float("nan"))]), {}, "frequency nan"),
        (fomoe_bytes(2, [(1, 1, 0.5), (1, 1, 0.25)]), {}, "listed twice"),
    ],
)
def test_bad_files_are_refused_with_what_is_wrong(tmp_path, data, kwargs, message):
    path = tmp_path / "bad.freq"
    path.write_bytes(data)
    with pytest.raises(FomoeError, match=message):
        read_freq(path, **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(FomoeError, match="cannot read profile"):
        read_freq(tmp_path / "nope.freq")


def test_counter_refuses_ids_beyond_u16():
    with pytest.raises(FomoeError, match="u16"):
        ExpertCounter(2, 70_000)


def test_seed_order_fills_vram_then_dram():
    profile = FreqProfile(2, sorted_entries(np.array([0, 0, 1, 1, 0]), np.array([0, 1, 2, 3, 4]),
                                            np.array([0.9, 0.8, 0.7, 0.6, 0.5], dtype=np.float32)))
    cache = ExpertCache(8, (10, 10), device_bytes=20, host_bytes=20)
    device, host = cache.seed(seed_order(profile))
    assert device == [(0, 0), (0, 1)] and host == [(1, 2), (1, 3)]
    assert cache.resident(0) == {0, 1} and cache.resident(1, "host") == {2, 3}
