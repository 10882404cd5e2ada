"""A GGUF file opened once: its metadata as plain Python values and an index of its tensors' bytes.

The header is parsed here (see `_HeaderParser` for why not with `gguf.GGUFReader`) with the `gguf`
package's format constants, into the two things the rest of fomoepy needs (a metadata dict and
`name -> TensorInfo`); every way a file can be broken becomes one `ModelFileError` naming the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from fomoepy.errors import ModelFileError

_FOLIO_MAX = 2 << 20  # the largest page-cache folio one fault maps (x86-64's PMD size)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are. `shape` is numpy order (ggml `ne` reversed)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def slice_bytes(self, index: int) -> tuple[int, int]:
        """(offset, nbytes) of `tensor[index]` along the outermost axis, e.g. one expert of a 3-D expert tensor."""
        count = self.shape[0]
        if not 0 <= index < count:
            raise IndexError(f"{self.name}: index {index} outside [0, {count})")
        size = self.nbytes // count
        return self.offset + index * size, size


class GGUFFile:
    """Metadata and tensor index of one GGUF file; tensor bytes are memory-mapped, never copied."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: {'is a directory, not a GGUF file' if self.path.is_dir() else 'no such file'}")
        if self.path.stat().st_size == 0:
            raise ModelFileError(f"{self.path}: truncated GGUF file (it is empty)")
        try:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{self.path}: cannot map ({_describe(e)})") from None
        try:
            self.metadata, self.tensors = _HeaderParser(self._data).parse()
        except _Truncated as e:
            raise ModelFileError(f"{self.path}: truncated GGUF file ({e})") from None
        except ValueError as e:
            raise ModelFileError(f"{self.path}: not a valid GGUF file ({e})") from None
        # slices of a plain ndarray view cost a third of a memmap's (no memmap bookkeeping per slice);
        # a decode step slices three per expert; the view keeps the map alive
        self._bytes = self._data.view(np.ndarray)
        size = len(self._data)
        for info in self.tensors.values():
            if info.offset + info.nbytes > size:
                raise ModelFileError(
                    f"{self.path}: truncated GGUF file: tensor {info.name} ends at byte "
                    f"{info.offset + info.nbytes:,}, the file has {size:,}"
                )

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        return info

    def raw_file(self) -> np.ndarray:
        """The whole file as a read-only uint8 array over the map (slice it by absolute offsets)."""
        return self._bytes

    def drop_pages(self, *ranges: tuple[int, int]) -> None:
        """Unmap the pages around each (offset, nbytes) range that reading through the map made resident.

        The page cache keeps them; only this process's resident set shrinks (a later read faults them
        back in). Each window is widened to 2 MiB boundaries: kernels that cache files in large folios
        map a whole folio, up to that size, on one fault, so a 4 KiB read can add 2 MiB to the RSS.
        Overlapping windows are merged, one system call each."""
        mm = getattr(self._data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        windows = sorted(
            (max(0, offset - offset % _FOLIO_MAX), min(len(self._data), -(-(offset + nbytes) // _FOLIO_MAX) * _FOLIO_MAX))
            for offset, nbytes in ranges
            if nbytes > 0
        )
        merged: list[list[int]] = []
        for start, end in windows:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def raw(self, info: TensorInfo, offset: int | None = None, nbytes: int | None = None) -> np.ndarray:
        """The bytes of `info` (or of a sub-range given as an absolute offset) as a read-only uint8 view."""
        start = info.offset if offset is None else offset
        size = info.nbytes if nbytes is None else nbytes
        return self._bytes[start : start + size]


class _Truncated(Exception):
    pass


# GGUF scalar value types -> struct format (little-endian)
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_SCALARS = {t: np.dtype(f) for t, f in _SCALARS.items()}


# Arrays of arrays: model files nest them a level or two at most; the limit keeps a crafted
# file's nesting from exhausting Python's recursion limit
MAX_ARRAY_DEPTH = 16


class _HeaderParser:
    """Reads a GGUF header (v2/v3, little-endian).

    The `gguf` package's reader builds a numpy view per array element, which takes ~12 s for a
    150k-token vocabulary; this parser reads the same header in well under a second. The `gguf`
    package still supplies every format constant (magic, value types, quant block sizes).

        magic u32 | version u32 | n_tensors u64 | n_kv u64
        n_kv x (key: str, type: u32, value)            str = u64 length + UTF-8 bytes
        n_tensors x (name: str, n_dims: u32, ne: u64[n_dims], type: u32, offset: u64)
        padding to general.alignment (default 32) | tensor data (offsets relative to here)
    """

    def __init__(self, data: np.ndarray):
        self.buf = memoryview(data)  # type: ignore[arg-type]
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"needed {n} bytes at offset {self.pos:,}, the file has {len(self.buf):,}")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"string at offset {self.pos - n:,} is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY_SCALARS:
                dt = _NUMPY_SCALARS[GGUFValueType(etype)]
                arr = np.frombuffer(self.take(count * dt.itemsize), dtype=dt)
                return arr.tolist()
            if etype == GGUFValueType.ARRAY:
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep at offset {self.pos:,}")
                return [self.value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
            raise ValueError(f"unknown array element type {etype}")
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[GGUFValueType(vtype)])
        raise ValueError(f"unknown metadata value type {vtype}")

    def parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        magic = self.scalar("<I")
        if magic != GGUF_MAGIC:
            raise ValueError(f"bad magic {magic:#010x}, expected {GGUF_MAGIC:#010x} ('GGUF')")
        version = self.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors = self.scalar("<Q")
        n_kv = self.scalar("<Q")
        if n_tensors > len(self.buf) or n_kv > len(self.buf):
            raise ValueError(f"header claims {n_tensors} tensors and {n_kv} keys, more than the file could hold")
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self.string()
            metadata[key] = self.value(self.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            ne = [self.scalar("<Q") for _ in range(n_dims)]
            qtype = self.scalar("<I")
            offset = self.scalar("<Q")
            raw_infos.append((name, ne, qtype, offset))
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise ValueError(f"general.alignment {alignment!r} is not a positive multiple of 8")
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ne, qtype, offset in raw_infos:
            try:
                gtype = GGMLQuantizationType(qtype)
            except ValueError:
                raise ValueError(f"tensor {name} has unknown type id {qtype}") from None
            block, type_size = GGML_QUANT_SIZES[gtype]
            if ne and ne[0] % block:
                raise ValueError(f"tensor {name}: row of {ne[0]} elements is not a multiple of {gtype.name} blocks ({block})")
            n_elems = int(np.prod(ne, dtype=np.int64)) if ne else 1
            tensors[name] = TensorInfo(
                name=name,
                qtype=gtype,
                shape=tuple(int(n) for n in reversed(ne)),
                offset=data_start + offset,
                nbytes=n_elems // block * type_size,
            )
        return metadata, tensors


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Just the metadata of a GGUF file (tokenizer-only files have no tensors)."""
    return GGUFFile(path).metadata


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
