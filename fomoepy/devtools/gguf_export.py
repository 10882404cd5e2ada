"""Write a qwen3moe GGUF from given weights (a trained model) and a given vocabulary.

The layout is make_test_model's: the same tensor names, shapes, types and order (`tensor_plan`), the
same hyper-parameter keys, the same `general.file_type` naming of the expert mix. Only the values
differ: weights come from the caller instead of a random generator, and the vocabulary is the
caller's (a `bpe_vocab.Vocab`) instead of the built-in one.

`k_quant_mix` picks tensor types like llama-quantize's Q4_K_M does for MoE experts, including its
fallback: a K-quant needs rows of a multiple of 256 values, so a matrix whose rows are shorter
(ffn_down_exps rows are expert_ff long) falls back to Q8_0, as llama-quantize does for Q6_K.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from fomoepy import quants
from fomoepy.devtools.bpe_vocab import CHATML_TEMPLATE, Vocab
from fomoepy.devtools.make_test_model import (
    _FILE_TYPES,
    ModelSpec,
    ModelSummary,
    summarize,
    tensor_plan,
)
from fomoepy.devtools.make_test_model import write_metadata as mtm_write_metadata

Q = GGMLQuantizationType
QK_K = 256


def k_quant_mix(n_embd: int, expert_ff: int) -> dict[str, object]:
    """ModelSpec fields of a Q4_K_M-like file: experts gate/up Q4_K, down Q6_K, dense matrices Q8_0
    (norms and the router stay F32 in every file). Rows that K-quants cannot hold fall back to Q8_0."""

    def k_or_q8(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
        return qtype if row % QK_K == 0 else Q.Q8_0

    return {
        "expert_types": (k_or_q8(Q.Q4_K, n_embd), k_or_q8(Q.Q4_K, n_embd), k_or_q8(Q.Q6_K, expert_ff)),
        "dense_type": Q.Q8_0,
    }


def write_metadata(w: GGUFWriter, spec: ModelSpec, vocab: Vocab, chat_template: str) -> None:
    """make_test_model's qwen3moe key-value pairs, with `vocab` as the tokenizer."""
    # llama-quantize names the file by the mix it was asked for, whatever fallbacks it applied
    mix = _FILE_TYPES.get(spec.expert_types)
    if mix is None and spec.expert_types[:2] == (Q.Q4_K, Q.Q4_K):
        mix = LlamaFileType.MOSTLY_Q4_K_M
    mtm_write_metadata(w, spec, vocab, chat_template, mix if mix is not None else LlamaFileType.GUESSED)


def write_qwen3moe(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    vocab: Vocab,
    weights: Mapping[str, np.ndarray],
    chat_template: str = CHATML_TEMPLATE,
) -> ModelSummary:
    """Write `weights` (float arrays by GGUF tensor name, numpy shapes as in tensor_plan) quantised to
    the types `spec` gives; written under a temporary name and renamed, so `path` never holds half a file."""
    if spec.arch != "qwen3moe":
        raise ValueError(f"arch: expected 'qwen3moe', got {spec.arch!r}")
    if spec.n_vocab != len(vocab.tokens):
        raise ValueError(f"n_vocab: expected {len(vocab.tokens)} (the vocabulary's size), got {spec.n_vocab}")
    plan = tensor_plan(spec)
    missing = [t.name for t in plan if t.name not in weights]
    extra = sorted(set(weights) - {t.name for t in plan})
    if missing or extra:
        raise ValueError(f"weights: missing {missing}, unexpected {extra}")
    for t in plan:
        if tuple(weights[t.name].shape) != t.shape:
            raise ValueError(f"{t.name}: expected shape {t.shape}, got {tuple(weights[t.name].shape)}")

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(partial, spec.arch)
    try:
        write_metadata(w, spec, vocab, chat_template)
        for t in plan:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            w.write_tensor_data(quants.quantize(np.asarray(weights[t.name], np.float32), t.qtype, t.name).reshape(-1))
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    w.close()
    os.replace(partial, path)
    return summarize(spec, path)
