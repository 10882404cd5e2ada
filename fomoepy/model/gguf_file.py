"""A GGUF file opened once: its metadata as plain Python values and an index of its tensors' bytes.

Reading goes through the `gguf` package; this module only turns its reader into the two things the
rest of fomoepy needs (a metadata dict and `name -> TensorInfo`), and turns every way a file can be
broken into one `ModelFileError` that names the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from fomoepy.errors import ModelFileError


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
            raise ModelFileError(f"{self.path}: no such file")
        try:
            reader = GGUFReader(self.path, "r")
        except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
            raise ModelFileError(f"{self.path}: not a valid GGUF file ({_describe(e)})") from None
        self._reader = reader
        try:
            self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{self.path}: unreadable metadata ({_describe(e)})") from None
        self.tensors: dict[str, TensorInfo] = {}
        file_size = self.path.stat().st_size
        for t in reader.tensors:
            info = TensorInfo(
                name=t.name,
                qtype=GGMLQuantizationType(int(t.tensor_type)),
                shape=tuple(int(n) for n in reversed(t.shape.tolist())),
                offset=int(t.data_offset),
                nbytes=int(t.n_bytes),
            )
            if info.offset + info.nbytes > file_size:
                raise ModelFileError(
                    f"{self.path}: truncated: tensor {t.name} ends at byte {info.offset + info.nbytes}, "
                    f"file has {file_size}"
                )
            self.tensors[t.name] = info

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
        """The whole file as a read-only uint8 memory map (slice it by absolute offsets)."""
        return self._reader.data

    def raw(self, info: TensorInfo, offset: int | None = None, nbytes: int | None = None) -> np.ndarray:
        """The bytes of `info` (or of a sub-range given as an absolute offset) as a read-only uint8 view."""
        start = info.offset if offset is None else offset
        size = info.nbytes if nbytes is None else nbytes
        return self._reader.data[start : start + size]


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Just the metadata of a GGUF file (tokenizer-only files have no tensors)."""
    return GGUFFile(path).metadata


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
