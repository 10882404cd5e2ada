"""fomoepy.devtools.make_test_model: generated models are laid out exactly like the oracle fixtures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, TokenType

from fomoepy import quants
from fomoepy.devtools import make_test_model as mtm
from fomoepy.devtools.bpe_vocab import SPECIAL_TOKENS, byte_level_bpe, bytes_to_unicode

Q = GGMLQuantizationType
ORACLE = Path(__file__).parent / "fixtures" / "oracle"
MANIFEST = json.loads((ORACLE / "MANIFEST.json").read_text())["models"]
PRESET_OF_ORACLE = {
    "qwen3moe_f32": "tiny-qwen3moe",
    "qwen3moe_q8_0": "tiny-qwen3moe-q8_0",
    "qwen3moe_q4_k_m": "tiny-qwen3moe-q4km",
    "qwen3moe_q6_k": "tiny-qwen3moe-q6k",
    "qwen35moe_f32": "tiny-qwen35moe",
    "qwen35moe_q4_k": "tiny-qwen35moe-q4k",
}
# keys whose value is allowed to differ from the oracle's; tokenizer.chat_template is ours only
FREE_VALUES = {"general.name"}
OUR_EXTRA_KEYS = {"tokenizer.chat_template"}
SPEC_FIELDS = {f.name for f in dataclasses.fields(mtm.ModelSpec)}


def oracle_spec_fields(name: str) -> dict:
    """ModelSpec fields of an oracle model, from its MANIFEST entry."""
    entry = MANIFEST[name]
    hp, types = entry["hparams"], entry["tensor_types"]
    fields = {k: v for k, v in hp.items() if k in SPEC_FIELDS}
    if entry["arch"] == "qwen3moe":  # rope on the whole head: rope.dimension_count is head_dim
        assert fields.pop("rotary_dim") == fields["head_dim"]
    if "rope_sections" in fields:
        fields["rope_sections"] = tuple(fields["rope_sections"])
    fields["arch"] = entry["arch"]
    fields["expert_types"] = tuple(Q[types[k]] for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    fields["dense_type"] = Q[types["dense"]]
    fields["router_scale"] = entry["generator"]["router_scale"]
    return fields


def metadata(reader: GGUFReader) -> dict[str, tuple[list[int], object]]:
    """key -> (GGUF value types, value), without the header pseudo-fields."""
    return {k: ([int(t) for t in f.types], f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensor_layout(reader: GGUFReader) -> list[tuple[str, tuple[int, ...], str, int]]:
    return [(t.name, tuple(int(n) for n in t.shape), t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]


@pytest.mark.parametrize("oracle_name", sorted(PRESET_OF_ORACLE))
def test_preset_has_the_oracle_hyperparameters(oracle_name):
    want = oracle_spec_fields(oracle_name)
    got = dataclasses.asdict(mtm.make_spec(PRESET_OF_ORACLE[oracle_name]))
    for key, value in want.items():
        assert got[key] == value, key


@pytest.mark.parametrize("oracle_name", sorted(PRESET_OF_ORACLE))
def test_layout_equals_the_oracle_file(oracle_name, tmp_path):
    entry = MANIFEST[oracle_name]
    out = tmp_path / "m.gguf"
    mtm.make_model(out, seed=entry["generator"]["model_seed"], **oracle_spec_fields(oracle_name))
    ours, ref = GGUFReader(out), GGUFReader(ORACLE / entry["files"]["gguf"])

    ours_md, ref_md = metadata(ours), metadata(ref)
    assert [k for k in ours_md if k not in OUR_EXTRA_KEYS] == list(ref_md)  # same keys, same order
    for key, (types, value) in ref_md.items():
        assert ours_md[key][0] == types, key
        if key not in FREE_VALUES and not key.startswith("tokenizer."):
            assert ours_md[key][1] == value, key
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"):
        assert ours_md[key][1] == ref_md[key][1], key
    assert len(ours_md["tokenizer.ggml.tokens"][1]) == entry["hparams"]["n_vocab"]

    assert tensor_layout(ours) == tensor_layout(ref)
    assert ours.alignment == ref.alignment


@pytest.mark.parametrize("oracle_name", ["qwen3moe_f32", "qwen35moe_f32"])
def test_weight_statistics_resemble_the_oracle(oracle_name, tmp_path):
    """Same distributions as the oracle's generator: std per tensor, norms around 1, ssm_a negative."""
    out = tmp_path / "m.gguf"
    mtm.make_model(out, seed=7, **oracle_spec_fields(oracle_name))
    ref = {t.name: t.data for t in GGUFReader(ORACLE / MANIFEST[oracle_name]["files"]["gguf"]).tensors}
    for t in GGUFReader(out).tensors:
        ours = np.asarray(t.data, dtype=np.float64)
        theirs = np.asarray(ref[t.name], dtype=np.float64)
        if ours.size >= 64:
            assert ours.std() == pytest.approx(theirs.std(), rel=0.3), t.name
            assert ours.mean() == pytest.approx(theirs.mean(), abs=0.1 + 0.1 * theirs.std()), t.name
        if t.name.endswith("ssm_a"):
            assert np.all(ours < 0)
        if "norm" in t.name:
            assert 0.95 < ours.mean() < 1.05, t.name


def test_same_arguments_give_byte_identical_files(tmp_path):
    args = {"preset": "tiny-qwen35moe", "n_layer": 4, "seed": 11}
    mtm.make_model(tmp_path / "a.gguf", **args)
    mtm.make_model(tmp_path / "b.gguf", **args)
    mtm.make_model(tmp_path / "c.gguf", **{**args, "seed": 12})
    a, b, c = ((tmp_path / f"{x}.gguf").read_bytes() for x in "abc")
    assert a == b
    assert a != c and len(a) == len(c)


def test_a_fresh_process_writes_the_same_bytes(tmp_path):
    """The BPE trainer and the per-chunk generators do not depend on process state or thread count."""
    mtm.make_model(tmp_path / "here.gguf", preset="tiny-qwen3moe", seed=5)
    script = Path(__file__).parents[1] / "tools" / "make_test_model.py"
    cmd = [
        sys.executable,
        str(script),
        str(tmp_path / "there.gguf"),
        "--preset",
        "tiny-qwen3moe",
        "--seed",
        "5",
        "--threads",
        "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    assert (tmp_path / "here.gguf").read_bytes() == (tmp_path / "there.gguf").read_bytes()


TYPE_CASES = [((t, t, t), t) for t in quants.SUPPORTED] + [
    ((Q.Q4_K, Q.Q4_K, Q.Q6_K), Q.Q8_0),
    ((Q.Q5_K, Q.Q5_K, Q.Q6_K), Q.Q4_0),
    ((Q.MXFP4, Q.MXFP4, Q.Q8_0), Q.BF16),
]


@pytest.mark.parametrize("arch", mtm.ARCHS)
@pytest.mark.parametrize(
    "expert_types,dense_type", TYPE_CASES, ids=lambda v: "-".join(t.name for t in v) if isinstance(v, tuple) else v.name
)
def test_every_type_combination_loads_and_decodes(arch, expert_types, dense_type, tmp_path):
    out = tmp_path / "m.gguf"
    # every row length a multiple of 256 so that K-quants fit everywhere
    mtm.make_model(
        out,
        arch=arch,
        n_embd=256,
        n_layer=4 if arch == "qwen35moe" else 1,
        n_head=8,
        head_dim=32,
        n_expert=4,
        n_expert_used=2,
        expert_ff=256,
        ssm_inner_size=256,
        shared_expert_ff=256,
        expert_types=expert_types,
        dense_type=dense_type,
        seed=3,
    )
    reader = GGUFReader(out)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if t.name.endswith("_exps.weight"):
            kind = ("gate", "up", "down").index(t.name.split(".")[-2].split("_")[1])
            assert t.tensor_type == expert_types[kind]
        elif len(shape) == 1 or t.name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight")):
            assert t.tensor_type == Q.F32, t.name
        else:
            assert t.tensor_type == dense_type, t.name
        w = quants.dequantize(t.data, t.tensor_type, shape, tensor_name=t.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(w, ref)
        assert np.all(np.isfinite(w))
        if t.name.endswith("_exps.weight"):  # N(0, 1/fan_in) survives quantisation
            assert w.std() * np.sqrt(shape[-1]) == pytest.approx(1.0, rel=0.1)


def test_vocabulary_is_a_consistent_byte_level_bpe():
    vocab = byte_level_bpe(512)
    tokens = vocab.tokens
    assert len(tokens) == 512 and len(set(tokens)) == 512
    b2u = bytes_to_unicode()
    assert list(tokens[:256]) == [b2u[b] for b in range(256)]
    assert tokens[-3:] == SPECIAL_TOKENS
    assert vocab.token_types[-3:] == (TokenType.CONTROL,) * 3
    assert set(vocab.token_types[:-3]) == {TokenType.NORMAL}
    assert (vocab.bos_id, vocab.pad_id, vocab.eos_id) == (509, 509, 511)
    known = set(tokens)
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= known, merge

    # an HF tokenizer made of exactly these tokens and merges round-trips text
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from fomoepy.devtools.bpe_vocab import QWEN2_PRE_REGEX

    bpe = models.BPE({t: i for i, t in enumerate(tokens[:-3])}, [tuple(m.split(" ")) for m in vocab.merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    text = "def main(argv):\n    return 42  # héllo, 世界!\r\n"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode())  # merges are used
    assert tok.decode(ids) == text


def test_bench_preset_is_about_half_a_gigabyte():
    spec = mtm.make_spec("bench-qwen3moe")
    plan = mtm.tensor_plan(spec)
    assert 0.5e9 < sum(t.nbytes for t in plan) < 0.7e9
    experts = [t for t in plan if t.is_expert]
    assert {(t.shape, t.qtype) for t in experts} == {((64, 512, 1024), Q.Q4_K), ((64, 1024, 512), Q.Q6_K)}
    assert len(byte_level_bpe(spec.n_vocab).tokens) == 32000


def test_cli_writes_a_model_and_prints_one_line(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert (
        mtm.main(
            [
                str(out),
                "--preset",
                "tiny-qwen3moe-q4km",
                "--seed",
                "2",
                "--n-layer",
                "1",
                "--expert-types",
                "q4_k,q5_k,q6_k",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: ") and "parameters" in line and "\n" not in line
    reader = GGUFReader(out)
    assert [t.tensor_type for t in reader.tensors if t.name.endswith("_exps.weight")] == [Q.Q4_K, Q.Q5_K, Q.Q6_K]
    assert reader.fields["general.name"].contents() == "fomoepy-test-qwen3moe-seed2"
    assert reader.fields["tokenizer.chat_template"].types == [GGUFValueType.STRING]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"arch": "llama"}, "arch: expected one of"),
        ({"n_head": 6, "n_head_kv": 4}, "multiple of n_head_kv"),
        ({"expert_types": (Q.Q4_K,) * 3}, "row length 128 is not a multiple of the Q4_K block size"),
        ({"arch": "qwen35moe", "rope_sections": (1, 1, 1, 0)}, "rope_sections"),
        ({"n_expert_used": 20}, "n_expert_used"),
    ],
)
def test_invalid_specs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        mtm.make_spec(**fields)


def test_cli_reports_a_bad_spec_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="make_test_model: n_expert_used"):
        mtm.main([str(tmp_path / "x.gguf"), "--n-expert-used", "99"])


def test_spec_accepts_lists_and_type_ids():
    spec = mtm.make_spec(expert_types=[8, 8, 8], dense_type=0)
    assert spec.expert_types == (Q.Q8_0,) * 3 and spec.dense_type is Q.F32
    assert hash(spec)
