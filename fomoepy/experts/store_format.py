"""The expert store's on-disk format: one table of facts, the byte layouts, and their (de)serialisers.

A store is one directory per drive. Each directory holds record files and, written last, a manifest:

    fomoe-store.manifest        the same in every directory but for its `slot` (which directory it is)
    layer-0000.s0.experts       one record file per (layer, stripe): exactly that layer's experts of that
    layer-0000.s1.experts       stripe. Striped store: directory k holds the stripe-k files. Mirrored
    ...                         store: one stripe, and every directory holds all of it.

Record file (layer L, stripe s), every offset a multiple of ALIGN (4 KiB) so O_DIRECT can read a record:

    0         file header block (FILE_HEADER_SIZE = 4096 bytes)
                0 magic "FOMOEXPR" | 8 version u32 | 12 layer u32 | 16 stripe u32 | 20 n_records u32
                | 24 file_size u64 | 32 binding sha256 (32 B) | 64 crc32 of [0, 64) u32 | zeros
    4096      record 0: gate | up | down bytes of one expert, in their GGUF quant types | zeros to 4 KiB
    4096+R    record 1 ...          R = slot_nbytes = record_nbytes rounded up to ALIGN (one R per layer)
    file_size = 4096 + n_records · R

Manifest (little-endian):

    0   magic "FOMOESTM" | 8 version u32 | 12 crc32 of [16, end) u32 | 16 json_len u64 | 24 n_records u64
    32  header JSON (UTF-8): format facts, GGUF binding, layer layouts, record files, slot
    align_up(32 + json_len, 8)   index: n_records × INDEX_DTYPE rows, row i = (layer, expert) in order

A record's checksum is CRC-32C of its whole slot (payload and zero padding), started from the CRC-32C
of its (layer, expert): a flip anywhere in the slot, or a record read from the wrong place, fails it.
CRC-32C (the `crc32c` package: the CPU's crc32 instruction, the interpreter lock released) runs at
~28 GB/s here against ~1-4 GB/s for zlib.crc32, so verifying every read costs the disk nothing; version
1 stores (zlib crc32) are refused with a message to run `fomoe prepare` again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
from gguf import GGMLQuantizationType

from fomoepy.errors import StoreError
from fomoepy.experts.source import LayerExperts
from fomoepy.model.gguf_file import GGUFFile

# --- format facts: everything below is derived from this table --------------------------------------
VERSION = 2  # 2: CRC-32C record checksums (1: zlib crc32)
ALIGN = 4096  # record and header alignment: the largest logical block size O_DIRECT asks for
FILE_HEADER_SIZE = ALIGN
FILE_MAGIC = b"FOMOEXPR"
MANIFEST_MAGIC = b"FOMOESTM"
MANIFEST_NAME = "fomoe-store.manifest"
MANIFEST_MAX_BYTES = 1 << 30  # a sanity bound before reading a damaged length field
SAMPLE_BYTES = 4096  # bytes hashed at the start, middle and end of every expert tensor (binding)
INDEX_DTYPE = np.dtype(
    [("layer", "<u4"), ("expert", "<u4"), ("file", "<u4"), ("crc", "<u4"), ("offset", "<u8"), ("nbytes", "<u8")]
)
_FILE_HEADER = struct.Struct("<8sIIIIQ32s")  # magic, version, layer, stripe, n_records, file_size, binding
_MANIFEST_PROLOGUE = struct.Struct("<8sIIQQ")  # magic, version, crc, json_len, n_records
_IDENTITY = struct.Struct("<II")  # (layer, expert) that seeds a record's crc


def align_up(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


def record_checksum(layer: int, expert: int, chunks: Iterable[Any]) -> int:
    """CRC-32C of a record slot given as consecutive buffers, seeded with its identity."""
    crc = crc32c.crc32c(_IDENTITY.pack(layer, expert))
    for chunk in chunks:
        crc = crc32c.crc32c(chunk, crc)
    return crc


def record_file_name(layer: int, stripe: int) -> str:
    return f"layer-{layer:04d}.s{stripe}.experts"


# --- the GGUF a store belongs to ----------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFBinding:
    """What ties a store to one GGUF: its size, its expert tensor table and a sample of the expert bytes."""

    file_size: int
    table_sha256: str  # names, types, shapes, offsets and sizes of every expert tensor
    sample_sha256: str  # SAMPLE_BYTES at the start, middle and end of every expert tensor
    file_name: str = ""  # for messages only, not compared
    model_name: str = ""  # general.name, for messages only

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(f"{self.file_size}:{self.table_sha256}:{self.sample_sha256}".encode()).digest()

    def describe(self) -> str:
        return f"{self.file_name or '?'} ({self.model_name or 'unnamed'}, {self.file_size:,} bytes)"


def bind_gguf(gf: GGUFFile, layers: tuple[LayerExperts, ...]) -> GGUFBinding:
    table = hashlib.sha256()
    sample = hashlib.sha256()
    for layer in layers:
        for part in layer.parts:
            info = gf.tensor(part.tensor)
            table.update(json.dumps([info.name, info.qtype.name, info.shape, info.offset, info.nbytes]).encode())
            starts = sorted({0, max(0, info.nbytes // 2 - SAMPLE_BYTES // 2), max(0, info.nbytes - SAMPLE_BYTES)})
            ranges = [(info.offset + start, min(SAMPLE_BYTES, info.nbytes - start)) for start in starts]
            for offset, n in ranges:
                sample.update(gf.raw(info, offset, n))
            gf.drop_pages(*ranges)  # experts come from the store: hold none of the GGUF's (a tensor at a time)
    return GGUFBinding(
        file_size=gf.path.stat().st_size,
        table_sha256=table.hexdigest(),
        sample_sha256=sample.hexdigest(),
        file_name=gf.path.name,
        model_name=str(gf.get("general.name", "")),
    )


# --- layouts, files, manifest -----------------------------------------------------------------------


@dataclass(frozen=True)
class PartLayout:
    """gate, up or down of one expert as stored: GGUF quant type, numpy-order shape, byte size."""

    tensor: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    nbytes: int


@dataclass(frozen=True)
class LayerLayout:
    layer: int
    n_expert: int
    parts: tuple[PartLayout, PartLayout, PartLayout]  # gate, up, down

    @property
    def record_nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def slot_nbytes(self) -> int:
        return align_up(self.record_nbytes)

    @classmethod
    def of(cls, gf: GGUFFile, experts: LayerExperts) -> LayerLayout:
        n_expert = gf.tensor(experts.parts[0].tensor).shape[0]
        parts = tuple(PartLayout(p.tensor, p.qtype, p.shape, p.nbytes) for p in experts.parts)
        return cls(experts.layer, n_expert, parts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RecordFile:
    name: str
    layer: int
    stripe: int
    n_records: int


@dataclass(frozen=True)
class StoreManifest:
    """The whole store: binding, layouts, files and the (layer, expert) index. `slot` is this copy's directory."""

    binding: GGUFBinding
    n_dirs: int
    mirror: bool
    layers: tuple[LayerLayout, ...]
    files: tuple[RecordFile, ...]
    index: np.ndarray = dataclasses.field(compare=False)  # INDEX_DTYPE, row = layer_base[layer] + expert
    slot: int = 0

    @property
    def n_stripes(self) -> int:
        return 1 if self.mirror else self.n_dirs

    def slots_of(self, file_id: int) -> tuple[int, ...]:
        """The directories (slots) that hold a copy of file `file_id`."""
        return tuple(range(self.n_dirs)) if self.mirror else (self.files[file_id].stripe,)

    def file_size(self, file_id: int) -> int:
        f = self.files[file_id]
        return FILE_HEADER_SIZE + f.n_records * self.layers[f.layer].slot_nbytes

    def file_header(self, file_id: int) -> bytes:
        """The exact header block of a record file (deterministic, so a kept file can be compared to it)."""
        f = self.files[file_id]
        head = _FILE_HEADER.pack(FILE_MAGIC, VERSION, f.layer, f.stripe, f.n_records, self.file_size(file_id), self.binding.digest)
        head += struct.pack("<I", zlib.crc32(head))
        return head + bytes(FILE_HEADER_SIZE - len(head))

    def layer_base(self) -> list[int]:
        return [0, *np.cumsum([layer.n_expert for layer in self.layers]).tolist()]

    def total_bytes(self) -> int:
        """Bytes of one copy of every record file."""
        return sum(self.file_size(i) for i in range(len(self.files)))

    def same_store(self, other: StoreManifest) -> bool:
        return encode_manifest(dataclasses.replace(self, slot=0)) == encode_manifest(dataclasses.replace(other, slot=0))


def check_file_header(block: bytes, manifest: StoreManifest, file_id: int, path: Path) -> None:
    """Raise StoreError naming `path` unless `block` is the header record file `file_id` must have."""
    expected = manifest.file_header(file_id)
    if block == expected:
        return
    layer = manifest.files[file_id].layer
    magic, version, f_layer, stripe, _, _, digest = _FILE_HEADER.unpack_from(block)
    (crc,) = struct.unpack_from("<I", block, _FILE_HEADER.size)
    if magic != FILE_MAGIC:
        why = f"bad magic {magic!r}, expected {FILE_MAGIC!r}"
    elif crc != zlib.crc32(block[: _FILE_HEADER.size]):
        why = "header checksum mismatch"
    elif version != VERSION:
        why = f"format version {version}, expected {VERSION}"
    elif digest != manifest.binding.digest:
        why = "it was written from a different GGUF"
    elif (f_layer, stripe) != (layer, manifest.files[file_id].stripe):
        why = f"it holds layer {f_layer} stripe {stripe}"
    else:
        why = "header differs from the manifest"
    raise StoreError(f"{path}: damaged record file of layer {layer} ({why}); run `fomoe prepare` again")


def encode_manifest(m: StoreManifest) -> bytes:
    header = {
        "format": "fomoe expert store",
        "version": VERSION,
        "alignment": ALIGN,
        "slot": m.slot,
        "n_dirs": m.n_dirs,
        "mirror": m.mirror,
        "gguf": dataclasses.asdict(m.binding),
        "layers": [
            {"layer": ll.layer, "n_expert": ll.n_expert,
             "parts": [[p.tensor, p.qtype.name, list(p.shape), p.nbytes] for p in ll.parts]}
            for ll in m.layers
        ],
        "files": [[f.name, f.layer, f.stripe, f.n_records] for f in m.files],
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    index = np.ascontiguousarray(m.index, dtype=INDEX_DTYPE).tobytes()
    pad = bytes(align_up(_MANIFEST_PROLOGUE.size + len(body), 8) - _MANIFEST_PROLOGUE.size - len(body))
    rest = struct.pack("<QQ", len(body), len(m.index)) + body + pad + index
    return MANIFEST_MAGIC + struct.pack("<II", VERSION, zlib.crc32(rest)) + rest


def decode_manifest(data: bytes, path: Path) -> StoreManifest:
    """Parse and check a manifest; any damage is a StoreError naming `path`."""

    def damaged(why: str) -> StoreError:
        return StoreError(f"{path}: damaged store manifest ({why}); run `fomoe prepare` again")

    if len(data) < _MANIFEST_PROLOGUE.size:
        raise damaged(f"{len(data)} bytes, shorter than its {_MANIFEST_PROLOGUE.size}-byte header")
    magic, version, crc, json_len, n_records = _MANIFEST_PROLOGUE.unpack_from(data)
    if magic != MANIFEST_MAGIC:
        raise damaged(f"bad magic {magic!r}, expected {MANIFEST_MAGIC!r}")
    if version != VERSION:
        raise StoreError(f"{path}: store format version {version}, this fomoe reads version {VERSION}; run `fomoe prepare` again")
    if crc != zlib.crc32(data[16:]):
        raise damaged("checksum mismatch")
    index_at = align_up(_MANIFEST_PROLOGUE.size + json_len, 8)
    if len(data) != index_at + n_records * INDEX_DTYPE.itemsize:
        raise damaged(f"expected {index_at + n_records * INDEX_DTYPE.itemsize:,} bytes, found {len(data):,}")
    try:
        h = json.loads(data[_MANIFEST_PROLOGUE.size : _MANIFEST_PROLOGUE.size + json_len])
        manifest = StoreManifest(
            binding=GGUFBinding(**h["gguf"]),
            n_dirs=int(h["n_dirs"]),
            mirror=bool(h["mirror"]),
            layers=tuple(
                LayerLayout(int(ll["layer"]), int(ll["n_expert"]), tuple(
                    PartLayout(str(t), GGMLQuantizationType[q], (int(s[0]), int(s[1])), int(n)) for t, q, s, n in ll["parts"]
                ))
                for ll in h["layers"]
            ),
            files=tuple(RecordFile(str(n), int(ly), int(s), int(c)) for n, ly, s, c in h["files"]),
            index=np.frombuffer(data, dtype=INDEX_DTYPE, count=n_records, offset=index_at),
            slot=int(h["slot"]),
        )
        if h["alignment"] != ALIGN:
            raise ValueError(f"alignment {h['alignment']}, expected {ALIGN}")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise damaged(f"unreadable header: {e}") from None
    problem = _index_problem(manifest)
    if problem:
        raise damaged(problem)
    return manifest


def _index_problem(m: StoreManifest) -> str | None:
    """Why the index cannot be right for its own layouts and files, or None."""
    if not 0 <= m.slot < m.n_dirs:
        return f"slot {m.slot} outside [0, {m.n_dirs})"
    idx = m.index
    base = m.layer_base()
    if len(idx) != base[-1]:
        return f"{len(idx)} index rows for {base[-1]} experts"
    layer_of = np.repeat(np.arange(len(m.layers)), [ll.n_expert for ll in m.layers])
    if not (np.array_equal(idx["layer"], layer_of) and np.array_equal(idx["expert"], np.arange(len(idx)) - np.array(base[:-1])[layer_of])):
        return "index rows out of (layer, expert) order"
    if len(idx) and idx["file"].max() >= len(m.files):
        return "index names a file the manifest lacks"
    file_layer = np.array([f.layer for f in m.files])[idx["file"]]
    sizes = np.array([m.file_size(i) for i in range(len(m.files))])[idx["file"]]
    slot = np.array([ll.slot_nbytes for ll in m.layers])[layer_of]
    nbytes = np.array([ll.record_nbytes for ll in m.layers])[layer_of]
    if not np.array_equal(file_layer, layer_of):
        return "an index row points into another layer's file"
    if np.any(idx["offset"] % ALIGN) or np.any(idx["offset"] < FILE_HEADER_SIZE) or np.any(idx["offset"] + slot > sizes):
        return "an index offset is unaligned or outside its file"
    if not np.array_equal(idx["nbytes"], nbytes):
        return "an index size differs from its layer's record size"
    return None


def read_manifest(directory: Path) -> StoreManifest:
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        what = "not a directory (a store is the directory fomoe prepare wrote)" if directory.exists() else "no such directory"
        raise StoreError(f"{directory}: {what}")
    try:
        size = path.stat().st_size
        if size > MANIFEST_MAX_BYTES:
            raise StoreError(f"{path}: damaged store manifest ({size:,} bytes is implausibly large)")
        data = path.read_bytes()
    except FileNotFoundError:
        partial = any(directory.glob("*.experts*"))
        hint = "`fomoe prepare` did not finish: run it again" if partial else "run `fomoe prepare` first"
        raise StoreError(f"{directory}: no complete expert store here (no {MANIFEST_NAME}; {hint})") from None
    except OSError as e:
        raise StoreError(f"{path}: cannot read ({e.strerror})") from None
    return decode_manifest(data, path)
