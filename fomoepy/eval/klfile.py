"""KL base files: the base run's log-probs of every scored position, written chunk by chunk.

fomoe's own format (written by `--kl-base`), little-endian:

    offset   size             field
    0        8                magic b"FOMOE-KL"
    8        4                uint32 format version (1)
    12       4                uint32 H: length of the JSON header, space-padded so that 16 + H is a multiple of 64
    16       H                JSON header: n_ctx, n_vocab, n_chunks, n_scored, top_k (= n_vocab for full rows),
                              full_rows, bos_id, model and text fingerprints, tokens_sha256
    16+H     4 n_chunks n_ctx int32 tokens of every chunk (original ids), zero-padded to a multiple of 64
    T0       n_chunks x R     one record per chunk, S = n_scored positions:
                                ids      int32   [S, K]   (top-K files only)
                                logp     float32 [S, K]
                                log_tail float64 [S]
                                nll      float64 [S]
                              R = S (8K + 16) bytes for top-K, S (4V + 16) for full rows

A record is complete once written and fsynced, so a killed run leaves whole records plus at most one partial
one, which `--resume` cuts off. llama-perplexity's `--kl-divergence-base` files (magic "_logits_", every log-prob
quantised to uint16) are read as full-row bases too.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.eval.kl import BaseRows

MAGIC = b"FOMOE-KL"
VERSION = 1
LLAMA_MAGIC = b"_logits_"
ALIGN = 64


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def record_nbytes(n_scored: int, n_vocab: int, top_k: int, full_rows: bool) -> int:
    k = n_vocab if full_rows else top_k
    return n_scored * ((4 if full_rows else 8) * k + 16)


@dataclass(frozen=True)
class KlBaseLayout:
    header: dict[str, Any]
    tokens_offset: int
    records_offset: int
    record_nbytes: int

    @classmethod
    def of(cls, header: dict[str, Any]) -> KlBaseLayout:
        h = _header_bytes(header)
        tokens_offset = 16 + len(h)
        n_tok = header["n_chunks"] * header["n_ctx"]
        rec = record_nbytes(header["n_scored"], header["n_vocab"], header["top_k"], header["full_rows"])
        return cls(header, tokens_offset, tokens_offset + _padded(4 * n_tok), rec)


def _header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, sort_keys=True).encode()
    return raw + b" " * (_padded(16 + len(raw)) - 16 - len(raw))


def _fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


class KlBaseWriter:
    """Writes a fomoe KL base file, one chunk record per `append`; `n_done` > 0 continues a killed run."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], tokens: np.ndarray, n_done: int = 0):
        self.path = Path(path)
        self.layout = KlBaseLayout.of(header)
        self.n_done = n_done
        if n_done == 0:
            self._create(header, tokens)
        else:
            self._reopen(header, n_done)

    def _create(self, header: dict[str, Any], tokens: np.ndarray) -> None:
        try:
            self.f: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (open across chunks; close())
        except OSError as e:
            raise FomoeError(f"{self.path}: cannot write ({e.strerror})") from None
        h = _header_bytes(header)
        tok = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        self.f.write(MAGIC + struct.pack("<II", VERSION, len(h)) + h)
        self.f.write(tok + b"\0" * (_padded(len(tok)) - len(tok)))
        _fsync(self.f)

    def _reopen(self, header: dict[str, Any], n_done: int) -> None:
        found = read_fomoe_header(self.path)
        if found != json.loads(json.dumps(header)):
            diff = sorted(k for k in set(found) | set(header) if found.get(k) != header.get(k))
            raise FomoeError(
                f"{self.path}: KL base file of another run (differs in {', '.join(diff)}); delete it or the resume file"
            )
        end = self.layout.records_offset + n_done * self.layout.record_nbytes
        size = self.path.stat().st_size
        if size < end:
            raise FomoeError(
                f"{self.path}: holds {(size - self.layout.records_offset) // self.layout.record_nbytes} chunk records, "
                f"the resume file {n_done}: the two files do not belong together"
            )
        self.f = open(self.path, "r+b")  # noqa: SIM115 (open across chunks; close())
        self.f.truncate(end)  # drops a record written after the last one the resume file recorded
        self.f.seek(end)

    def append(self, rows: BaseRows) -> None:
        h = self.layout.header
        s, k = h["n_scored"], h["top_k"]
        if rows.logp.shape != (s, k) or (rows.ids is None) != h["full_rows"]:
            raise ValueError(f"base rows: expected logp [{s}, {k}], full_rows={h['full_rows']}, got {rows.logp.shape}")
        parts = [] if rows.ids is None else [rows.ids.astype("<i4")]
        parts += [rows.logp.astype("<f4"), rows.log_tail.astype("<f8"), rows.nll.astype("<f8")]
        self.f.write(b"".join(np.ascontiguousarray(p).tobytes() for p in parts))
        _fsync(self.f)
        self.n_done += 1

    def close(self) -> None:
        self.f.close()


def read_fomoe_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise FomoeError(f"{path}: not a fomoe KL base file")
        version, n = struct.unpack("<II", head[8:])
        if version != VERSION:
            raise FomoeError(f"{path}: KL base format version {version}; this fomoe reads version {VERSION}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise FomoeError(f"{path}: damaged KL base header") from None
    return header


class KlBase:
    """A complete base file opened for reading: `tokens`, and `rows(i)` for chunk i."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(8)
        except OSError as e:
            raise FomoeError(f"{self.path}: cannot read ({e.strerror})") from None
        if magic == MAGIC:
            self._open_fomoe()
        elif magic == LLAMA_MAGIC:
            self._open_llama()
        else:
            raise FomoeError(f"{self.path}: not a KL base file (neither fomoe's nor llama-perplexity's)")
        self.n_scored = self.n_ctx - 1 - self.n_ctx // 2
        expected = self.records_offset + self.n_chunks * self.record_nbytes
        size = self.path.stat().st_size
        if size < expected:
            done = max(size - self.records_offset, 0) // self.record_nbytes
            raise FomoeError(
                f"{self.path}: holds {done} of {self.n_chunks} chunks (the run that wrote it did not finish; "
                "run it again with the same --resume file)"
            )

    def _open_fomoe(self) -> None:
        self.kind = "fomoe"
        self.header = read_fomoe_header(self.path)
        layout = KlBaseLayout.of(self.header)
        h = self.header
        self.n_ctx, self.n_vocab, self.n_chunks = h["n_ctx"], h["n_vocab"], h["n_chunks"]
        self.top_k, self.full_rows = h["top_k"], h["full_rows"]
        self.records_offset, self.record_nbytes = layout.records_offset, layout.record_nbytes
        self.tokens = self._read(layout.tokens_offset, "<i4", self.n_chunks * self.n_ctx).astype(np.int64)

    def _open_llama(self) -> None:
        # "_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_ctx n_chunk], then per chunk and
        # scored position nv = 2 ceil(V/2) + 4 uint16: float32 scale, float32 min_log_prob, uint16 q[V] (+pad);
        # log p = scale q + min_log_prob.
        self.kind = "llama.cpp"
        self.n_ctx, self.n_vocab, self.n_chunks = (int(x) for x in self._read(8, "<i4", 3))
        if self.n_ctx < 3 or self.n_vocab < 1 or self.n_chunks < 1:
            raise FomoeError(f"{self.path}: damaged llama-perplexity KL base header")
        self.header = {"n_ctx": self.n_ctx, "n_vocab": self.n_vocab, "n_chunks": self.n_chunks}
        self.top_k, self.full_rows = self.n_vocab, True
        self.tokens = self._read(20, "<i4", self.n_chunks * self.n_ctx).astype(np.int64)
        self.nv = 2 * ((self.n_vocab + 1) // 2) + 4
        self.records_offset = 20 + 4 * self.n_chunks * self.n_ctx
        self.record_nbytes = (self.n_ctx - 1 - self.n_ctx // 2) * self.nv * 2

    def _read(self, offset: int, dtype: str, count: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(offset)
            raw = f.read(count * np.dtype(dtype).itemsize)
        if len(raw) < count * np.dtype(dtype).itemsize:
            raise FomoeError(f"{self.path}: truncated KL base file")
        return np.frombuffer(raw, dtype=dtype, count=count)

    def rows(self, i: int) -> BaseRows:
        s, k = self.n_scored, self.top_k
        if self.kind == "llama.cpp":
            q = self._read(self.records_offset + i * self.record_nbytes, "<u2", s * self.nv).reshape(s, self.nv)
            scale_min = q[:, :4].copy().view("<f4")  # [S, 2]
            logp = scale_min[:, :1] * q[:, 4 : 4 + self.n_vocab].astype(np.float32) + scale_min[:, 1:]
            start = i * self.n_ctx + self.n_ctx // 2 + 1
            targets = self.tokens[start : start + s]
            nll = -logp[np.arange(s), targets].astype(np.float64)
            return BaseRows(None, logp, np.full(s, -np.inf), nll)
        raw = self._read(self.records_offset + i * self.record_nbytes, "u1", self.record_nbytes)
        at = 0

        def take(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal at
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            a = np.frombuffer(raw[at : at + n].tobytes(), dtype=dtype).reshape(shape)
            at += n
            return a

        ids = None if self.full_rows else take("<i4", (s, k))
        logp = take("<f4", (s, k))
        return BaseRows(ids, logp, take("<f8", (s,)), take("<f8", (s,)))
