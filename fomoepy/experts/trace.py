"""Routing traces: the router's exact choices, recorded during a run and replayed by the simulator.

A trace is a msgpack stream: one header map, then one record map per (step, MoE layer):

    header  {"format": "fomoe-trace", "version": 1, "n_layer", "n_expert", "n_expert_used",
             "expert_bytes": [bytes of one expert, per layer] (may be empty), "model": str,
             "read_ahead": bool (optional): the engine read each step's predicted experts ahead}
    record  {"t": token index of the first row, "l": layer, "n": rows T, "k": k,
             "ids": T·k  u16 little-endian   selected experts, by descending probability
             "s":   T·k  f32                 their softmax probabilities
             "p":   T·E  f16 (optional)      every expert's probability, so CAR can be replayed
             "q":   u16 (optional)          the experts the engine predicted for this layer a layer
                                            earlier (its next-layer router on that layer's input; each
                                            row's first choice, then each row's second, ...): what
                                            it read ahead when read_ahead (timing only: the cache counts
                                            those reads as disk reads, so a replay has nothing to redo)
             "sq":  int, or T i64 (optional) each row's sequence (an int: all rows one sequence): a
                                            batched step's rows learn co-use from their own sequence
             "tk":  int (optional)          the policies' logical time at this step, where it is not t (a
                                            batched decode step is one tick for all its rows)}

Records hold the ORIGINAL selection (before any cache-aware substitution); `t` is the engine's
running token count, so it never goes backwards across prompts. A killed run leaves a partial last
record: the reader drops it and says so (`Trace.truncated`); damage before the last record is an error.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from fomoepy.errors import FomoeError

TRACE_FORMAT = "fomoe-trace"
TRACE_VERSION = 1
IDS, SCORES, PROBS, SEQS = np.dtype("<u2"), np.dtype("<f4"), np.dtype("<f2"), np.dtype("<i8")


@dataclass(frozen=True)
class TraceHeader:
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: tuple[int, ...] = ()  # per layer; () when unknown
    model: str = ""
    read_ahead: bool = False  # the engine read the records' predicted experts ahead (their "q")

    def to_msgpack(self) -> dict:
        return {
            "read_ahead": self.read_ahead,
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "expert_bytes": list(self.expert_bytes),
            "model": self.model,
        }


@dataclass(frozen=True)
class TraceRecord:
    token: int
    layer: int
    ids: np.ndarray  # [T, k] int64
    scores: np.ndarray  # [T, k] float32
    probs: np.ndarray | None  # [T, E] float16
    predicted: np.ndarray | None = None  # [m] int64: the experts predicted for this step a layer earlier
    sequences: np.ndarray | None = None  # [T] int64: each row's sequence, when recorded
    now: int | None = None  # the policies' logical time, when recorded (else: token)

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    records: tuple[TraceRecord, ...]
    truncated: bool = False  # a partial final record was dropped
    path: str = field(default="", compare=False)

    @property
    def n_tokens(self) -> int:
        """Distinct token indices seen (a step of T tokens counts T)."""
        return len({r.token + i for r in self.records for i in range(r.n_tokens)})

    @property
    def has_probs(self) -> bool:
        return bool(self.records) and all(r.probs is not None for r in self.records)

    @functools.cached_property
    def _predictions(self) -> tuple[list[int], list[int]]:
        """Per position of a record's prediction (the order reads are made ahead in): how many predictions
        there the router then chose, and how many there were; counted once per trace."""
        right: list[int] = []
        seen: list[int] = []
        for r in self.records:
            if r.predicted is None:
                continue
            chosen = set(r.ids.ravel().tolist())
            for i, e in enumerate(r.predicted.tolist()):
                if i == len(seen):
                    right.append(0)
                    seen.append(0)
                right[i] += e in chosen
                seen[i] += 1
        return right, seen

    def prediction_accuracy(self) -> tuple[float, int] | None:
        """(share of predicted experts the router then chose, how many were predicted), over the records
        that carry a prediction; None when none does (a trace of a run without prediction)."""
        right, seen = self._predictions
        predicted = sum(seen)
        return (sum(right) / predicted, predicted) if predicted else None

    def prediction_accuracy_by_rank(self) -> list[float]:
        """The share of predictions the router then chose at each position of a record's prediction (most
        confident first, in traces that keep the predictor's order); [] without any."""
        right, seen = self._predictions
        return [c / n for c, n in zip(right, seen)]


class TraceWriter:
    """Appends records to a new trace file; use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, header: TraceHeader):
        if header.n_expert > 1 << 16:
            raise FomoeError(f"trace stores expert ids as u16, got {header.n_expert} experts")
        if header.expert_bytes and len(header.expert_bytes) != header.n_layer:
            raise ValueError(f"expected {header.n_layer} expert sizes, got {len(header.expert_bytes)}")
        self.header = header
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - open for the writer's lifetime, closed by close()
        self._file.write(msgpack.packb(header.to_msgpack(), use_bin_type=True))

    def write(
        self, token: int, layer: int, ids: np.ndarray, scores: np.ndarray, probs: np.ndarray | None = None,
        predicted: np.ndarray | list[int] | None = None, sequences: np.ndarray | list[int] | None = None,
        now: int | None = None,
    ) -> None:
        """ids/scores [T, k] of the router's exact selection; probs [T, E] its softmax, or None; predicted:
        the experts predicted for this step a layer earlier (read ahead if the header says so), or None."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or np.shape(scores) != ids.shape:
            raise ValueError(f"expected ids and scores [T, k], got {ids.shape} and {np.shape(scores)}")
        if not 0 <= layer < self.header.n_layer:
            raise ValueError(f"expected a layer in [0, {self.header.n_layer}), got {layer}")
        record = {
            "t": int(token),
            "l": int(layer),
            "n": ids.shape[0],
            "k": ids.shape[1],
            "ids": ids.astype(IDS).tobytes(),
            "s": np.asarray(scores).astype(SCORES).tobytes(),
        }
        if probs is not None:
            if np.shape(probs) != (ids.shape[0], self.header.n_expert):
                raise ValueError(f"expected probs [{ids.shape[0]}, {self.header.n_expert}], got {np.shape(probs)}")
            record["p"] = np.asarray(probs).astype(PROBS).tobytes()
        if predicted is not None:
            record["q"] = np.asarray(predicted).astype(IDS).tobytes()
        if sequences is not None:
            seq = np.asarray(sequences, dtype=np.int64).reshape(-1)
            if seq.size != ids.shape[0]:
                raise ValueError(f"expected a sequence per row ({ids.shape[0]}), got {seq.size}")
            record["sq"] = int(seq[0]) if (seq == seq[0]).all() else seq.astype(SEQS).tobytes()
        if now is not None:
            record["tk"] = int(now)
        self._file.write(msgpack.packb(record, use_bin_type=True))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> TraceWriter:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trace(path: str | os.PathLike) -> Trace:
    """The whole trace; FomoeError naming the file and byte offset for anything but a cut-off tail."""
    path = Path(path)
    try:
        objects, end, size = _read_objects(path)
    except OSError as e:
        raise FomoeError(f"{path}: cannot read trace ({e.strerror})") from None
    if not objects:
        raise FomoeError(f"{path}: empty or cut-off trace (no header)")
    header = _parse_header(path, objects[0][1])
    records = tuple(_parse_record(path, offset, obj, header) for offset, obj in objects[1:])
    return Trace(header, records, truncated=end < size, path=str(path))


def _read_objects(path: Path) -> tuple[list[tuple[int, object]], int, int]:
    """(offset, object) of every complete msgpack object, the offset past the last one, the file size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=1 << 31, strict_map_key=False)
        objects = []
        end = 0  # offset just past the last complete object
        try:
            for obj in unpacker:
                objects.append((end, obj))
                end = unpacker.tell()
        except (msgpack.UnpackException, ValueError, TypeError) as e:
            raise FomoeError(f"{path}: not a msgpack trace at byte {end} ({e})") from None
    return objects, end, size


def _parse_header(path: Path, obj: object) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
        raise FomoeError(f"{path}: not a fomoe trace (expected format {TRACE_FORMAT!r} in the header)")
    if obj.get("version") != TRACE_VERSION:
        raise FomoeError(f"{path}: expected trace version {TRACE_VERSION}, got {obj.get('version')!r}")
    try:
        header = TraceHeader(
            n_layer=int(obj["n_layer"]),
            n_expert=int(obj["n_expert"]),
            n_expert_used=int(obj["n_expert_used"]),
            expert_bytes=tuple(int(b) for b in obj.get("expert_bytes", ())),
            model=str(obj.get("model", "")),
            read_ahead=bool(obj.get("read_ahead", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FomoeError(f"{path}: bad trace header ({e!r})") from None
    if header.expert_bytes and len(header.expert_bytes) != header.n_layer:
        raise FomoeError(f"{path}: expected {header.n_layer} expert sizes, got {len(header.expert_bytes)}")
    return header


def _parse_record(path: Path, offset: int, obj: object, header: TraceHeader) -> TraceRecord:
    where = f"{path}: record at byte {offset}"
    try:
        n, k, layer = int(obj["n"]), int(obj["k"]), int(obj["l"])  # type: ignore[index]
        ids = _array(obj["ids"], IDS, n * k, where, "ids").reshape(n, k).astype(np.int64)  # type: ignore[index]
        scores = _array(obj["s"], SCORES, n * k, where, "s").reshape(n, k)  # type: ignore[index]
        raw_p = obj.get("p")  # type: ignore[union-attr]
        probs = None if raw_p is None else _array(raw_p, PROBS, n * header.n_expert, where, "p").reshape(n, -1)
        raw_q = obj.get("q")  # type: ignore[union-attr]
        predicted = None if raw_q is None else _array(raw_q, IDS, _count(raw_q, IDS), where, "q").astype(np.int64)
        raw_sq = obj.get("sq")  # type: ignore[union-attr]
        if raw_sq is None or isinstance(raw_sq, bytes):
            sequences = None if raw_sq is None else _array(raw_sq, SEQS, n, where, "sq").astype(np.int64)
        else:
            sequences = np.full(n, int(raw_sq), np.int64)
        raw_tk = obj.get("tk")  # type: ignore[union-attr]
        now = None if raw_tk is None else int(raw_tk)
        token = int(obj["t"])  # type: ignore[index]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise FomoeError(f"{where}: malformed ({e!r})") from None
    if not 0 <= layer < header.n_layer:
        raise FomoeError(f"{where}: layer {layer} outside [0, {header.n_layer})")
    for name, a in (("expert", ids), ("predicted expert", predicted)):
        if a is not None and a.size and int(a.max()) >= header.n_expert:
            raise FomoeError(f"{where}: {name} id {int(a.max())} outside [0, {header.n_expert})")
    return TraceRecord(token, layer, ids, scores, probs, predicted, sequences, now)


def _count(raw: object, dtype: np.dtype) -> int:
    """Elements in a variable-length field (the check of its length is _array's)."""
    return len(raw) // dtype.itemsize if isinstance(raw, bytes) else 0


def _array(raw: object, dtype: np.dtype, count: int, where: str, name: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) != count * dtype.itemsize:
        got = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise FomoeError(f"{where}: expected {count * dtype.itemsize} bytes of {name}, got {got}")
    return np.frombuffer(raw, dtype=dtype)


def expert_sizes(header: TraceHeader, override: int | None = None) -> Sequence[int]:
    """Per-layer expert bytes for capacity maths: the override for every layer, else the header's."""
    if override is not None:
        if override <= 0:
            raise FomoeError(f"expert bytes must be > 0, got {override}")
        return (override,) * header.n_layer
    if not header.expert_bytes:
        raise FomoeError("the trace records no expert sizes; give --expert-bytes")
    return header.expert_bytes
