"""Frequency profiles: how often the router chose each (layer, expert), in FOMOE's `.freq` format.

File layout, little-endian, no padding:

    offset 0   u32 magic 0x46524551 ("QERF" as bytes; "FREQ" read as a u32)
           4   u32 version 1
           8   u32 n_layers
          12   u32 n_entries
          16   n_entries × { u16 layer, u16 expert, f32 freq }   (8 bytes each)

freq = count / n_tokens, the fraction of tokens whose router picked that expert in that layer
(FOMOE's normalisation); experts never picked are not listed; entries are sorted by descending
freq (ties: layer, then expert, so files are reproducible). Counts are of the router's ORIGINAL
choices, never of cache-aware substitutes, so a profile describes the model, not the cache.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.policy import Key
from fomoepy.outputs import atomic_output

FREQ_MAGIC = 0x46524551
FREQ_VERSION = 1
HEADER = struct.Struct("<IIII")
ENTRY = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("freq", "<f4")])  # 8 bytes, as FOMOE writes


@dataclass(frozen=True, eq=False)
class FreqProfile:
    n_layers: int
    entries: np.ndarray  # ENTRY records, sorted by descending freq

    def __len__(self) -> int:
        return len(self.entries)

    def items(self) -> list[tuple[int, int, float]]:
        return [(int(e["layer"]), int(e["expert"]), float(e["freq"])) for e in self.entries]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FreqProfile)
            and self.n_layers == other.n_layers
            and self.entries.tobytes() == other.entries.tobytes()
        )


def sorted_entries(layers: np.ndarray, experts: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    entries = np.empty(len(freqs), dtype=ENTRY)
    entries["layer"], entries["expert"], entries["freq"] = layers, experts, freqs
    return entries[np.lexsort((entries["expert"], entries["layer"], -entries["freq"].astype(np.float64)))]


class ExpertCounter:
    """Counts the router's original choices per (layer, expert) over a run.

    A decode step's row is kept aside and counted with the layer's next _PENDING rows in one bincount:
    a numpy update per step (~4 µs) was a tenth of a resident decode layer's host time."""

    _PENDING = 64

    def __init__(self, n_layer: int, n_expert: int):
        if n_expert > 1 << 16 or n_layer > 1 << 16:
            raise FomoeError(f".freq stores u16 ids, got {n_layer} layers x {n_expert} experts")
        self._counts = np.zeros((n_layer, n_expert), dtype=np.int64)
        self._tokens = np.zeros(n_layer, dtype=np.int64)  # tokens seen per layer
        self._pending: list[list[np.ndarray]] = [[] for _ in range(n_layer)]  # decode rows not counted yet
        self._pending_passes: list[np.ndarray] = []  # whole passes' choices not counted yet (add_layers)

    @property
    def counts(self) -> np.ndarray:
        """[n_layer, n_expert]: how often each expert was chosen."""
        for layer in range(len(self._pending)):
            self._flush(layer)
        self._flush_passes()
        return self._counts

    @property
    def tokens(self) -> np.ndarray:
        """[n_layer]: tokens seen per layer."""
        for layer in range(len(self._pending)):
            self._flush(layer)
        self._flush_passes()
        return self._tokens

    def add(self, layer: int, ids: np.ndarray) -> None:
        """ids [T, k]: the k experts each of T tokens chose in `layer` (kept as they are: the caller's
        arrays are not written afterwards)."""
        ids = np.asarray(ids)
        if ids.ndim == 2 and ids.shape[0] == 1:  # a decode step: one token's k experts
            pending = self._pending[layer]
            pending.append(ids)
            if len(pending) >= self._PENDING:
                self._flush(layer)
            return
        self._counts[layer] += np.bincount(ids.reshape(-1), minlength=self._counts.shape[1])
        self._tokens[layer] += ids.shape[0] if ids.ndim == 2 else 1

    def add_layers(self, ids: np.ndarray) -> None:
        """ids [n_layer, T, k]: every layer's choices for the same T tokens (a pass computed in one call),
        counted as `add` of each layer's [T, k] would count them, with the next _PENDING passes in one
        bincount (kept as they are, as `add` keeps its rows)."""
        self._pending_passes.append(ids)
        if len(self._pending_passes) >= self._PENDING:
            self._flush_passes()

    def _flush_passes(self) -> None:
        passes = self._pending_passes
        if passes:
            n_layer, n_expert = self._counts.shape
            # each layer's choices offset by its row of the counts: one bincount for every layer
            ids = np.concatenate([p.reshape(n_layer, -1) for p in passes], axis=1) + (np.arange(n_layer) * n_expert)[:, None]
            self._counts += np.bincount(ids.reshape(-1), minlength=n_layer * n_expert).reshape(n_layer, n_expert)
            self._tokens += sum(p.shape[1] for p in passes)
            passes.clear()

    def _flush(self, layer: int) -> None:
        pending = self._pending[layer]
        if pending:
            self._counts[layer] += np.bincount(np.concatenate(pending).reshape(-1), minlength=self._counts.shape[1])
            self._tokens[layer] += len(pending)
            pending.clear()

    def profile(self) -> FreqProfile:
        n_tokens = int(self.tokens.max(initial=0))
        layers, experts = np.nonzero(self.counts)
        # float32 count × float32 (1 / n_tokens), as FOMOE's freq_profile_from_counts computes it
        inv = np.float32(1.0) / np.float32(max(n_tokens, 1))
        freqs = self.counts[layers, experts].astype(np.float32) * inv
        return FreqProfile(self.counts.shape[0], sorted_entries(layers, experts, freqs))


def write_freq(path: str | os.PathLike, profile: FreqProfile) -> None:
    """Write atomically (temporary file, fsync, rename): a reader never sees half a profile, and a failed
    write leaves no temporary file."""
    with atomic_output(path) as f:
        f.write(HEADER.pack(FREQ_MAGIC, FREQ_VERSION, profile.n_layers, len(profile.entries)))
        f.write(profile.entries.astype(ENTRY).tobytes())


def read_freq(path: str | os.PathLike, n_layer: int | None = None, n_expert: int | None = None) -> FreqProfile:
    """Read and validate; with the model's n_layer / n_expert, ids beyond them are errors too.

    Entries come back in our order (descending freq, then layer, expert) whatever order the writer
    used for ties, so seed_order is reproducible.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FomoeError(f"{path}: cannot read profile ({e.strerror})") from None
    if len(data) < HEADER.size:
        raise FomoeError(f"{path}: expected a {HEADER.size}-byte .freq header, got {len(data)} bytes")
    magic, version, n_layers, n_entries = HEADER.unpack_from(data)
    if magic != FREQ_MAGIC:
        raise FomoeError(f"{path}: not a .freq profile (magic 0x{magic:08x}, expected 0x{FREQ_MAGIC:08x})")
    if version != FREQ_VERSION:
        raise FomoeError(f"{path}: expected .freq version {FREQ_VERSION}, got {version}")
    expected = HEADER.size + n_entries * ENTRY.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "trailing bytes"
        raise FomoeError(f"{path}: {what}: {n_entries} entries need {expected} bytes, got {len(data)}")
    if n_layer is not None and n_layers != n_layer:
        raise FomoeError(f"{path}: profile is for {n_layers} layers, the model has {n_layer}")
    entries = np.frombuffer(data, dtype=ENTRY, count=n_entries, offset=HEADER.size)
    _check_entries(str(path), entries, n_layers, n_expert)
    return FreqProfile(n_layers, sorted_entries(entries["layer"], entries["expert"], entries["freq"]))


def _check_entries(where: str, entries: np.ndarray, n_layers: int, n_expert: int | None) -> None:
    bad = np.flatnonzero(entries["layer"] >= n_layers)
    if bad.size:
        raise FomoeError(f"{where}: entry {bad[0]} has layer {entries['layer'][bad[0]]}, expected < {n_layers}")
    if n_expert is not None:
        bad = np.flatnonzero(entries["expert"] >= n_expert)
        if bad.size:
            e = entries["expert"][bad[0]]
            raise FomoeError(f"{where}: entry {bad[0]} has expert {e}, expected < {n_expert}")
    bad = np.flatnonzero(~np.isfinite(entries["freq"]) | (entries["freq"] < 0))
    if bad.size:
        raise FomoeError(f"{where}: entry {bad[0]} has frequency {entries['freq'][bad[0]]}, expected >= 0")
    keys = entries["layer"].astype(np.int64) << 16 | entries["expert"]
    if np.unique(keys).size != keys.size:
        raise FomoeError(f"{where}: an (layer, expert) pair is listed twice")


def seed_order(profile: FreqProfile) -> list[Key]:
    """Experts most used first: the order to fill VRAM, then DRAM, at start-up (ExpertCache.seed)."""
    return [(int(e["layer"]), int(e["expert"])) for e in profile.entries]
