"""GGUF header parsing: equal to the `gguf` package's reader, and one clear error for every broken file."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.errors import ModelFileError
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

SMALL_FILES = sorted(p.name for p in ORACLE.glob("*.gguf") if p.name != "real_qwen2.gguf")


@pytest.mark.parametrize("name", SMALL_FILES)
def test_header_equals_gguf_reader(name):
    ours = GGUFFile(ORACLE / name)
    ref = gguf.GGUFReader(ORACLE / name)
    assert ours.metadata == {k: f.contents() for k, f in ref.fields.items()}
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.offset, info.nbytes, info.qtype) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(ours.raw(info), t.data.reshape(-1).view(np.uint8))


def test_expert_slices_cover_the_tensor_exactly():
    gf = GGUFFile(ORACLE / "qwen3moe_q4_k_m.gguf")
    info = gf.tensor("blk.0.ffn_down_exps.weight")
    ranges = [info.slice_bytes(e) for e in range(info.shape[0])]
    assert ranges[0][0] == info.offset
    assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1][0] + ranges[-1][1] == info.offset + info.nbytes


@pytest.fixture
def model_bytes():
    return (ORACLE / "qwen3moe_q4_k_m.gguf").read_bytes()


@pytest.mark.parametrize("keep", [0, 3, 23, 2000, 1_000_000])
def test_truncated_file_is_one_clear_error(tmp_path, model_bytes, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:keep])
    with pytest.raises(ModelFileError, match=r"cut\.gguf: truncated GGUF file"):
        GGUFFile(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFileError, match="bad magic"):
        GGUFFile(path)


def test_unknown_tensor_type_id(tmp_path, model_bytes):
    gf = GGUFFile(ORACLE / "qwen3moe_q4_k_m.gguf")
    name = b"blk.0.ffn_down_exps.weight"
    at = model_bytes.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", model_bytes, at)[0]
    type_at = at + 4 + 8 * n_dims
    broken = bytearray(model_bytes)
    struct.pack_into("<I", broken, type_at, 250)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(broken))
    with pytest.raises(ModelFileError, match="unknown type id 250"):
        GGUFFile(path)
    assert gf.tensor(name.decode()).qtype == gguf.GGMLQuantizationType.Q6_K


def test_missing_file():
    with pytest.raises(ModelFileError, match="no such file"):
        GGUFFile(ORACLE / "nope.gguf")


@pytest.mark.parametrize("depth, ok", [(16, True), (17, False), (5000, False)])
def test_nested_metadata_arrays_have_a_depth_limit(tmp_path, depth, ok):
    # a crafted file nesting arrays 5000 deep exhausted Python's recursion (RecursionError)
    def string(text):
        return struct.pack("<Q", len(text)) + text.encode()

    arrays = struct.pack("<I", gguf.GGUFValueType.ARRAY) + struct.pack("<IQ", gguf.GGUFValueType.ARRAY, 1) * (depth - 1)
    innermost = struct.pack("<IQ", gguf.GGUFValueType.UINT8, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("k") + arrays + innermost)
    if ok:
        value = GGUFFile(path).metadata["k"]
        for _ in range(depth - 1):
            (value,) = value
        assert value == []
    else:
        with pytest.raises(ModelFileError, match=r"not a valid GGUF file \(metadata arrays nested more than 16 deep at offset"):
            GGUFFile(path)


def test_a_directory_is_not_called_missing(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory, not a GGUF file"):
        GGUFFile(tmp_path)


def _rewrite(src, dst, edit):
    """Copy a GGUF with edited metadata (edit(dict) -> dict), tensors unchanged."""
    reader = gguf.GGUFReader(src)
    kv = {k: (f.contents(), f.types) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    kv = edit(kv)
    w = gguf.GGUFWriter(dst, arch=str(kv.pop("general.architecture")[0]))
    for k, (v, types) in kv.items():
        vtype = types[0]
        sub = types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, v, vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_key_names_key_and_file(tmp_path):
    dst = tmp_path / "nokey.gguf"

    def drop(kv):
        del kv["qwen3moe.expert_used_count"]
        return kv

    _rewrite(ORACLE / "qwen3moe_f32.gguf", dst, drop)
    with pytest.raises(ModelFileError, match=r"nokey\.gguf: missing metadata key 'qwen3moe\.expert_used_count'"):
        ModelSpec.from_gguf(GGUFFile(dst))


def test_wrong_architecture(tmp_path):
    dst = tmp_path / "llama.gguf"

    def rename(kv):
        kv["general.architecture"] = ("llama", kv["general.architecture"][1])
        return kv

    _rewrite(ORACLE / "qwen3moe_f32.gguf", dst, rename)
    with pytest.raises(ModelFileError, match=r"architecture 'llama' is not supported \(supported: qwen3moe, qwen35moe\)"):
        ModelSpec.from_gguf(GGUFFile(dst))


def test_inconsistent_shape(tmp_path):
    dst = tmp_path / "shape.gguf"

    def more_heads(kv):
        kv["qwen3moe.attention.head_count"] = (8, kv["qwen3moe.attention.head_count"][1])
        return kv

    _rewrite(ORACLE / "qwen3moe_f32.gguf", dst, more_heads)
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.attn_q\.weight has shape \(128, 128\), expected \(256, 128\)"):
        ModelSpec.from_gguf(GGUFFile(dst))


def test_unsupported_quant_type_is_refused_at_load(tmp_path):
    src = ORACLE / "qwen3moe_f32.gguf"
    dst = tmp_path / "q4_1.gguf"
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch="qwen3moe")
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_up_exps.weight":
            q = gguf.quants.quantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from fomoepy.errors import UnsupportedQuantType

    with pytest.raises(UnsupportedQuantType, match=r"q4_1\.gguf: tensor blk\.1\.ffn_up_exps\.weight has type Q4_1, which fomoepy does not support"):
        ModelSpec.from_gguf(GGUFFile(dst))
