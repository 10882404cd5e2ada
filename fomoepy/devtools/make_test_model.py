"""Write tiny random-weight GGUF MoE models laid out exactly like the oracle fixtures (tests/fixtures/oracle).

Two architectures, as llama.cpp reads them:

    qwen3moe   pre-norm attention blocks (GQA, per-head q/k RMSNorm) + routed SwiGLU experts
    qwen35moe  Gated DeltaNet layers with full attention every `full_attention_interval`-th layer,
               routed experts plus a sigmoid-gated shared expert

Metadata keys, their GGUF value types and order, tensor names, shapes, types and order mirror the oracle
files (`tests/test_make_test_model.py` checks this against them). Conventions kept from them:
1-D tensors, the router `ffn_gate_inp`, `ssm_conv1d` (and `ssm_a`, `ssm_dt.bias`) are always F32; norms
are stored as used (`x̂ · w`, around 1); `ssm_a` is stored as `−exp(A_log)`, so it is negative.

Weights are drawn so that activations stay O(1) and logits have std ~1: matrices N(0, 1/fan_in),
embeddings N(0, 1), norms 1 + 0.1·N(0, 1), and the router scaled by `router_scale` so that its top-k
choices are rarely near-ties; `router_skew` scales router rows by popularity rank to give the experts
unequal usage. Every tensor chunk (one expert, a block of rows of a large matrix, or a
whole small tensor) has its own generator seeded from (seed, tensor index, chunk index): chunks are made
in parallel threads and the file is still byte-identical for the same arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    Keys,
    LlamaFileType,
)

from fomoepy import quants
from fomoepy.devtools.bpe_vocab import CHATML_TEMPLATE, Vocab, byte_level_bpe

Q = GGMLQuantizationType
F32 = Q.F32
ARCHS = ("qwen3moe", "qwen35moe")


@dataclass(frozen=True)
class ModelSpec:
    """Everything that decides a test model's bytes. Defaults: a tiny F32 qwen3moe (the oracle's qwen3moe_f32)."""

    arch: str = "qwen3moe"
    n_vocab: int = 512
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 16
    n_expert_used: int = 4
    expert_ff: int = 64
    context_length: int = 512
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    expert_types: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType] = (F32, F32, F32)
    dense_type: GGMLQuantizationType = F32  # token_embd, output and every other 2-D matrix but the router
    seed: int = 0
    router_scale: float = 4.0  # router logits ~ N(0, router_scale²) for a unit-RMS input
    # Router row scales by popularity rank (most used first), one per expert; empty: none. Each layer
    # gives them to its experts in its own random order. A row scaled by s has logits of s times the
    # spread, so it lands in the top k more often: usage skew without a bias (qwen3moe routers have none).
    router_skew: tuple[float, ...] = ()
    name: str = ""  # general.name; empty: "fomoepy-test-{arch}-seed{seed}"
    # qwen35moe only
    full_attention_interval: int = 4
    rotary_dim: int = 8
    rope_sections: tuple[int, int, int, int] = (1, 1, 2, 0)
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 32
    ssm_group_count: int = 2
    ssm_time_step_rank: int = 4
    ssm_inner_size: int = 128
    shared_expert_ff: int = 64

    def __post_init__(self) -> None:
        # accept lists and plain ints from callers; store the canonical, hashable form
        object.__setattr__(self, "expert_types", tuple(Q(t) for t in self.expert_types))
        object.__setattr__(self, "dense_type", Q(self.dense_type))
        object.__setattr__(self, "rope_sections", tuple(int(n) for n in self.rope_sections))
        object.__setattr__(self, "router_skew", tuple(float(s) for s in self.router_skew))
        if self.arch not in ARCHS:
            raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used must be in 1..n_expert ({self.n_expert}), got {self.n_expert_used}")
        if self.router_skew and (len(self.router_skew) != self.n_expert or min(self.router_skew) <= 0):
            raise ValueError(f"router_skew: expected {self.n_expert} positive scales (one per expert), got {len(self.router_skew)}")
        if len(self.expert_types) != 3:
            raise ValueError(f"expert_types: expected (gate, up, down), got {self.expert_types!r}")
        if self.arch == "qwen35moe":
            if self.ssm_inner_size % self.ssm_time_step_rank or self.ssm_time_step_rank % self.ssm_group_count:
                raise ValueError(
                    "ssm_inner_size must be a multiple of ssm_time_step_rank, and that of ssm_group_count "
                    f"(got {self.ssm_inner_size}, {self.ssm_time_step_rank}, {self.ssm_group_count})"
                )
            if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
                raise ValueError(f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {self.rotary_dim}")
            if len(self.rope_sections) != 4 or 2 * sum(self.rope_sections) != self.rotary_dim:
                raise ValueError(f"rope_sections must be 4 numbers summing to rotary_dim/2, got {self.rope_sections}")
        for t in tensor_plan(self):  # every row a whole number of blocks of its type
            quants.nbytes_for(t.qtype, t.shape, t.name)

    @property
    def general_name(self) -> str:
        return self.name or f"fomoepy-test-{self.arch}-seed{self.seed}"


# --- tensors ------------------------------------------------------------------------------------------

Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def _normal(std: float) -> Init:
    return lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _norm_weight(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return 1 + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32)


def _router(std: float, skew: tuple[float, ...]) -> Init:
    def init(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        w = _normal(std)(rng, shape)
        if not skew:  # no further draws: models without skew keep their bytes
            return w
        if shape[0] != len(skew):  # a router is one chunk unless n_expert x n_embd passes _CHUNK_ELEMENTS
            raise ValueError(f"router_skew needs the router in one chunk, got {shape[0]} of {len(skew)} rows")
        rank = rng.permutation(shape[0])  # expert e has popularity rank rank[e], drawn per layer
        return w * np.asarray(skew, dtype=np.float32)[rank][:, None]

    return init


def _ssm_a(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # stored as -exp(A_log): per-head decay rates between e^-2 and e^0.5
    return -np.exp(rng.uniform(-2.0, 0.5, shape)).astype(np.float32)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: ggml ne reversed; experts: [n_expert, rows, cols]
    qtype: GGMLQuantizationType
    init: Init = dataclasses.field(compare=False)

    @property
    def is_expert(self) -> bool:
        return len(self.shape) == 3

    @property
    def nbytes(self) -> int:
        return quants.nbytes_for(self.qtype, self.shape, self.name)


def _name(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> str:
    return TENSOR_NAMES[kind].format(bid=layer) + suffix


def tensor_plan(spec: ModelSpec) -> list[TensorPlan]:
    """Every tensor of the model in file order (the oracle files' order)."""
    E, D, V, hd = spec.n_embd, spec.dense_type, spec.n_vocab, spec.head_dim
    T = MODEL_TENSOR

    def norm(kind: MODEL_TENSOR, il: int | None, n: int) -> TensorPlan:
        return TensorPlan(_name(kind, il), (n,), F32, _norm_weight)

    def linear(kind: MODEL_TENSOR, il: int, n_out: int, n_in: int, qtype: GGMLQuantizationType = D) -> TensorPlan:
        return TensorPlan(_name(kind, il), (n_out, n_in), qtype, _normal(n_in**-0.5))

    plan = [
        TensorPlan(_name(T.TOKEN_EMBD), (V, E), D, _normal(1.0)),
        norm(T.OUTPUT_NORM, None, E),
        TensorPlan(_name(T.OUTPUT), (V, E), D, _normal(E**-0.5)),
    ]
    for il in range(spec.n_layer):
        full_attention = spec.arch == "qwen3moe" or (il + 1) % spec.full_attention_interval == 0
        plan.append(norm(T.ATTN_NORM, il, E))
        if spec.arch == "qwen35moe":
            plan.append(norm(T.ATTN_POST_NORM, il, E))
        if full_attention:
            q_rows = spec.n_head * hd * (2 if spec.arch == "qwen35moe" else 1)  # qwen35: [q, gate] per head
            plan += [
                linear(T.ATTN_Q, il, q_rows, E),
                linear(T.ATTN_K, il, spec.n_head_kv * hd, E),
                linear(T.ATTN_V, il, spec.n_head_kv * hd, E),
                linear(T.ATTN_OUT, il, E, spec.n_head * hd),
                norm(T.ATTN_Q_NORM, il, hd),
                norm(T.ATTN_K_NORM, il, hd),
            ]
        else:
            n_v_heads, inner = spec.ssm_time_step_rank, spec.ssm_inner_size
            conv_channels = 2 * spec.ssm_group_count * spec.ssm_state_size + inner  # [q, k, v]
            plan += [
                linear(T.ATTN_QKV, il, conv_channels, E),
                linear(T.ATTN_GATE, il, inner, E),
                TensorPlan(
                    _name(T.SSM_CONV1D, il),
                    (conv_channels, spec.ssm_conv_kernel),
                    F32,
                    _normal(spec.ssm_conv_kernel**-0.5),
                ),
                TensorPlan(_name(T.SSM_DT, il, ".bias"), (n_v_heads,), F32, _normal(0.5)),
                TensorPlan(_name(T.SSM_A, il, ""), (n_v_heads,), F32, _ssm_a),
                linear(T.SSM_BETA, il, n_v_heads, E),
                linear(T.SSM_ALPHA, il, n_v_heads, E),
                norm(T.SSM_NORM, il, inner // n_v_heads),
                linear(T.SSM_OUT, il, E, inner),
            ]
        if spec.arch == "qwen3moe":
            plan.append(norm(T.FFN_NORM, il, E))
        gate_t, up_t, down_t = spec.expert_types
        F, X = spec.expert_ff, spec.n_expert
        plan += [
            TensorPlan(_name(T.FFN_GATE_INP, il), (X, E), F32, _router(spec.router_scale * E**-0.5, spec.router_skew)),
            TensorPlan(_name(T.FFN_GATE_EXP, il), (X, F, E), gate_t, _normal(E**-0.5)),
            TensorPlan(_name(T.FFN_UP_EXP, il), (X, F, E), up_t, _normal(E**-0.5)),
            TensorPlan(_name(T.FFN_DOWN_EXP, il), (X, E, F), down_t, _normal(F**-0.5)),
        ]
        if spec.arch == "qwen35moe":
            S = spec.shared_expert_ff
            plan += [
                TensorPlan(_name(T.FFN_GATE_INP_SHEXP, il), (E,), F32, _normal(E**-0.5)),
                linear(T.FFN_GATE_SHEXP, il, S, E),
                linear(T.FFN_UP_SHEXP, il, S, E),
                linear(T.FFN_DOWN_SHEXP, il, E, S),
            ]
    return plan


# --- metadata -----------------------------------------------------------------------------------------

# general.file_type from the expert types, as llama-quantize would name the mix
_FILE_TYPES: dict[tuple[GGMLQuantizationType, ...], LlamaFileType] = {
    (Q.F32,) * 3: LlamaFileType.ALL_F32,
    (Q.F16,) * 3: LlamaFileType.MOSTLY_F16,
    (Q.BF16,) * 3: LlamaFileType.MOSTLY_BF16,
    (Q.Q8_0,) * 3: LlamaFileType.MOSTLY_Q8_0,
    (Q.Q4_0,) * 3: LlamaFileType.MOSTLY_Q4_0,
    (Q.Q4_K,) * 3: LlamaFileType.MOSTLY_Q4_K_S,
    (Q.Q4_K, Q.Q4_K, Q.Q6_K): LlamaFileType.MOSTLY_Q4_K_M,
    (Q.Q5_K,) * 3: LlamaFileType.MOSTLY_Q5_K_S,
    (Q.Q5_K, Q.Q5_K, Q.Q6_K): LlamaFileType.MOSTLY_Q5_K_M,
    (Q.Q6_K,) * 3: LlamaFileType.MOSTLY_Q6_K,
    (Q.MXFP4,) * 3: LlamaFileType.MOSTLY_MXFP4_MOE,
}


def write_metadata(
    w: GGUFWriter,
    spec: ModelSpec,
    vocab: Vocab | None = None,
    chat_template: str = CHATML_TEMPLATE,
    file_type: LlamaFileType | None = None,
) -> None:
    """Key-value pairs in the oracle files' order (general.architecture is written by GGUFWriter itself).

    vocab: the tokenizer to embed (default: the built-in byte-level BPE of spec.n_vocab tokens);
    file_type: general.file_type (default: named from the expert types, as llama-quantize would)."""
    a = spec.arch
    L, A, R, S, Tk = Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM, Keys.Tokenizer
    w.add_string(Keys.General.NAME, spec.general_name)
    w.add_uint32(L.CONTEXT_LENGTH.format(arch=a), spec.context_length)
    w.add_uint32(L.EMBEDDING_LENGTH.format(arch=a), spec.n_embd)
    w.add_uint32(L.BLOCK_COUNT.format(arch=a), spec.n_layer)
    w.add_uint32(L.FEED_FORWARD_LENGTH.format(arch=a), spec.n_expert_used * spec.expert_ff)
    w.add_uint32(A.HEAD_COUNT.format(arch=a), spec.n_head)
    w.add_uint32(A.HEAD_COUNT_KV.format(arch=a), spec.n_head_kv)
    w.add_uint32(A.KEY_LENGTH.format(arch=a), spec.head_dim)
    w.add_uint32(A.VALUE_LENGTH.format(arch=a), spec.head_dim)
    w.add_float32(A.LAYERNORM_RMS_EPS.format(arch=a), spec.rms_eps)
    w.add_float32(R.FREQ_BASE.format(arch=a), spec.rope_freq_base)
    w.add_uint32(L.EXPERT_COUNT.format(arch=a), spec.n_expert)
    w.add_uint32(L.EXPERT_USED_COUNT.format(arch=a), spec.n_expert_used)
    w.add_uint32(L.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), spec.expert_ff)
    if file_type is None:
        file_type = _FILE_TYPES.get(spec.expert_types, LlamaFileType.GUESSED)
    w.add_uint32(Keys.General.FILE_TYPE, file_type)

    if vocab is None:
        vocab = byte_level_bpe(spec.n_vocab)
    w.add_string(Tk.MODEL, "gpt2")
    w.add_string(Tk.PRE, "qwen2")
    w.add_array(Tk.LIST, list(vocab.tokens))
    w.add_array(Tk.TOKEN_TYPE, list(vocab.token_types))
    w.add_array(Tk.MERGES, list(vocab.merges))
    w.add_uint32(Tk.EOS_ID, vocab.eos_id)
    w.add_uint32(Tk.BOS_ID, vocab.bos_id)
    w.add_uint32(Tk.PAD_ID, vocab.pad_id)
    w.add_bool(Tk.ADD_BOS, False)
    w.add_string(Tk.CHAT_TEMPLATE, chat_template)

    if a == "qwen3moe":
        w.add_uint32(R.DIMENSION_COUNT.format(arch=a), spec.head_dim)
        return
    w.add_uint32(R.DIMENSION_COUNT.format(arch=a), spec.rotary_dim)
    w.add_array(R.DIMENSION_SECTIONS.format(arch=a), list(spec.rope_sections))
    w.add_uint32(S.CONV_KERNEL.format(arch=a), spec.ssm_conv_kernel)
    w.add_uint32(S.STATE_SIZE.format(arch=a), spec.ssm_state_size)
    w.add_uint32(S.GROUP_COUNT.format(arch=a), spec.ssm_group_count)
    w.add_uint32(S.TIME_STEP_RANK.format(arch=a), spec.ssm_time_step_rank)
    w.add_uint32(S.INNER_SIZE.format(arch=a), spec.ssm_inner_size)
    w.add_uint32(L.FULL_ATTENTION_INTERVAL.format(arch=a), spec.full_attention_interval)
    w.add_uint32(L.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a), spec.shared_expert_ff)


# --- writing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSummary:
    path: Path
    nbytes: int  # file size
    n_params: int
    n_expert_params: int
    n_active_params: int  # per token: everything but the experts, plus n_expert_used experts per layer

    def line(self) -> str:
        return (
            f"{self.path}: {self.nbytes / 1e6:.1f} MB, {self.n_params / 1e6:.2f}M parameters "
            f"({self.n_expert_params / 1e6:.2f}M in experts, {self.n_active_params / 1e6:.2f}M active per token)"
        )


_CHUNK_ELEMENTS = 1 << 20


def _chunks(t: TensorPlan) -> list[tuple[int, ...]]:
    """Shapes generated one at a time (each from its own generator, possibly in parallel): one expert of
    an expert tensor, blocks of rows of a large matrix, else the whole tensor."""
    if t.is_expert:
        return [t.shape[1:]] * t.shape[0]
    if len(t.shape) == 1:
        return [t.shape]
    rows, cols = t.shape
    step = max(1, _CHUNK_ELEMENTS // cols)
    return [(min(step, rows - start), cols) for start in range(0, rows, step)]


def _tensor_bytes(spec: ModelSpec, index: int, t: TensorPlan, pool: ThreadPoolExecutor) -> np.ndarray:
    def make(chunk: int) -> np.ndarray:
        rng = np.random.default_rng([spec.seed, index, chunk])
        return quants.quantize(t.init(rng, shapes[chunk]), t.qtype, t.name).reshape(-1)

    shapes = _chunks(t)
    return np.concatenate(list(pool.map(make, range(len(shapes)))))


def write_model(path: str | os.PathLike[str], spec: ModelSpec, threads: int | None = None) -> ModelSummary:
    """Write `spec` as a GGUF file at `path`, streaming one tensor at a time.

    The file is written under a temporary name and renamed at the end, so `path` never holds half a model.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    plan = tensor_plan(spec)
    w = GGUFWriter(partial, spec.arch)
    try:
        write_metadata(w, spec)
        for t in plan:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            for index, t in enumerate(plan):
                w.write_tensor_data(_tensor_bytes(spec, index, t, pool))
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    w.close()
    os.replace(partial, path)
    return summarize(spec, path)


def summarize(spec: ModelSpec, path: Path) -> ModelSummary:
    plan = tensor_plan(spec)
    n_params = sum(int(np.prod(t.shape)) for t in plan)
    n_expert = sum(int(np.prod(t.shape)) for t in plan if t.is_expert)
    n_active = n_params - n_expert + n_expert * spec.n_expert_used // spec.n_expert
    nbytes = path.stat().st_size if path.exists() else 0
    return ModelSummary(path, nbytes, n_params, n_expert, n_active)


# --- presets, make_model, CLI -------------------------------------------------------------------------

_Q4KM = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
_QWEN35 = {"arch": "qwen35moe", "rope_freq_base": 1e7, "n_layer": 4}
_WIDE = {"n_embd": 256, "n_head": 8}

# The six tiny ones have the hyperparameters and types of the oracle fixtures of the same kind.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen3moe": {},
    "tiny-qwen3moe-q8_0": {**_WIDE, "expert_ff": 128, "expert_types": (Q.Q8_0,) * 3},
    "tiny-qwen3moe-q4km": {**_WIDE, "n_layer": 3, "expert_ff": 256, "expert_types": _Q4KM, "dense_type": Q.Q8_0},
    "tiny-qwen3moe-q6k": {**_WIDE, "expert_ff": 256, "expert_types": (Q.Q6_K,) * 3, "dense_type": Q.F16},
    "tiny-qwen35moe": {**_QWEN35, "expert_ff": 32},
    "tiny-qwen35moe-q4k": {
        **_QWEN35,
        **_WIDE,
        "n_expert": 8,
        "n_expert_used": 2,
        "expert_ff": 256,
        "expert_types": (Q.Q4_K,) * 3,
    },
    # ~0.6 GB: 8 layers x 64 experts of 3 x 512 x 1024, for throughput measurements
    "bench-qwen3moe": {
        "n_vocab": 32000,
        "n_embd": 1024,
        "n_layer": 8,
        "n_head": 16,
        "n_head_kv": 4,
        "head_dim": 64,
        "n_expert": 64,
        "n_expert_used": 8,
        "expert_ff": 512,
        "context_length": 4096,
        "expert_types": _Q4KM,
        "dense_type": Q.Q8_0,
    },
}


def make_spec(preset: str | None = None, **fields: Any) -> ModelSpec:
    """A ModelSpec from a preset (or the defaults) with `fields` overriding it."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    return ModelSpec(**{**(PRESETS[preset] if preset else {}), **fields})


def make_model(path: str | os.PathLike[str], *, preset: str | None = None, **fields: Any) -> ModelSummary:
    """Write a random test model: `make_model("m.gguf", arch="qwen35moe", n_embd=256, seed=3)`.

    `fields` are ModelSpec fields (arch, n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_expert,
    n_expert_used, expert_ff, context_length, rope_freq_base, rms_eps, expert_types, dense_type, seed,
    router_scale, router_skew, name, and for qwen35moe full_attention_interval, rotary_dim, rope_sections,
    ssm_conv_kernel, ssm_state_size, ssm_group_count, ssm_time_step_rank, ssm_inner_size, shared_expert_ff).
    """
    return write_model(path, make_spec(preset, **fields))


def _qtype(text: str) -> GGMLQuantizationType:
    try:
        return Q[text.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown tensor type {text!r}") from None


def _tuple_of(parse: Callable[[str], Any], n: int) -> Callable[[str], tuple[Any, ...]]:
    def parse_all(text: str) -> tuple[Any, ...]:
        items = tuple(parse(s) for s in text.split(","))
        if n > 1 and len(items) == 1:
            items *= n
        if len(items) != n:
            raise argparse.ArgumentTypeError(f"expected {n} comma-separated values, got {text!r}")
        return items

    return parse_all


_FIELD_PARSERS: dict[str, Callable[[str], Any]] = {
    "expert_types": _tuple_of(_qtype, 3),
    "dense_type": _qtype,
    "rope_sections": _tuple_of(int, 4),
    "router_skew": lambda text: tuple(float(s) for s in text.split(",")),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="make_test_model", description="Write a random-weight qwen3moe/qwen35moe GGUF test model."
    )
    p.add_argument("out", type=Path, help="output .gguf path")
    p.add_argument("--preset", choices=list(PRESETS), help="starting point (default: the ModelSpec defaults)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    for f in dataclasses.fields(ModelSpec):
        parse = _FIELD_PARSERS.get(f.name) or type(f.default)
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=parse,
            default=None,
            help=f"default {f.default!r}" if f.name not in _FIELD_PARSERS else "comma-separated",
        )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSpec) if getattr(args, f.name) is not None}
    try:
        spec = make_spec(args.preset, **fields)
    except ValueError as e:
        raise SystemExit(f"make_test_model: {e}") from None
    print(write_model(args.out, spec, threads=args.threads).line())
    return 0
