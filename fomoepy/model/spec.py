"""ModelSpec: the hyper-parameters of a GGUF MoE model, read once from its metadata and validated.

Every size is read from the file (metadata keys through `gguf.Keys`, vocabulary and shapes from the
tensors); nothing is assumed from a model card. A missing or inconsistent value is one
`ModelFileError` naming the key or tensor and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import Keys

from fomoepy import quants
from fomoepy.errors import ModelFileError, UnsupportedQuantType
from fomoepy.model.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("qwen3moe", "qwen35moe")

ATTENTION = "attention"
DELTANET = "deltanet"


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length; n_head * head_dim need not equal n_embd
    rope_base: float
    rotary_dim: int  # NEOX rotation of the first rotary_dim dims of each head
    gated: bool  # qwen35moe: attn_q also yields a per-head output gate

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv


@dataclass(frozen=True)
class DeltaNetSpec:
    """Gated DeltaNet (qwen35moe linear-attention layers)."""

    conv_kernel: int
    state_size: int  # head dim of q and k
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    inner_size: int  # n_v_heads * v_head_dim

    @property
    def v_head_dim(self) -> int:
        return self.inner_size // self.n_v_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.state_size + self.inner_size


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_expert_used: int
    expert_ff: int
    shared_ff: int  # 0 when the architecture has no shared expert
    gating: str  # "softmax": softmax over all experts, top-k, renormalise the k weights
    shared_gate: bool  # the shared expert's output is scaled by sigmoid(h . ffn_gate_inp_shexp)


@dataclass(frozen=True)
class ModelSpec:
    path: str
    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    context_length: int
    rms_eps: float
    layer_kinds: tuple[str, ...]  # ATTENTION or DELTANET per layer
    attention: AttentionSpec
    moe: MoESpec
    deltanet: DeltaNetSpec | None
    tied_embeddings: bool

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> ModelSpec:
        return _SpecReader(gf).read()


class _SpecReader:
    def __init__(self, gf: GGUFFile):
        self.gf = gf
        self.arch = str(gf.require(Keys.General.ARCHITECTURE))

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def int(self, template: str, default: int | None = None, minimum: int = 1) -> int:
        key = self.key(template)
        value: Any = self.gf.get(key, default)
        if value is None:
            raise ModelFileError(f"{self.gf.path}: missing metadata key {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelFileError(f"{self.gf.path}: metadata {key!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, template: str, default: float | None = None) -> float:
        key = self.key(template)
        value: Any = self.gf.get(key, default)
        if value is None:
            raise ModelFileError(f"{self.gf.path}: missing metadata key {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelFileError(f"{self.gf.path}: metadata {key!r} must be a positive number, got {value!r}")
        return float(value)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise ModelFileError(f"{self.gf.path}: inconsistent model: {what}")

    def read(self) -> ModelSpec:
        gf = self.gf
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFileError(
                f"{gf.path}: architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if not gf.tensors:
            raise ModelFileError(f"{gf.path}: has no tensors (a vocabulary-only GGUF?), so it cannot be run")
        n_embd = self.int(Keys.LLM.EMBEDDING_LENGTH)
        n_layer = self.int(Keys.LLM.BLOCK_COUNT)
        n_head = self.int(Keys.Attention.HEAD_COUNT)
        n_head_kv = self.int(Keys.Attention.HEAD_COUNT_KV, default=n_head)
        self.check(n_head % n_head_kv == 0, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        head_dim = self.int(Keys.Attention.KEY_LENGTH, default=n_embd // n_head)
        value_dim = self.int(Keys.Attention.VALUE_LENGTH, default=head_dim)
        self.check(value_dim == head_dim, f"value_length {value_dim} != key_length {head_dim} is not supported")
        rotary_dim = self.int(Keys.Rope.DIMENSION_COUNT, default=head_dim)
        self.check(rotary_dim <= head_dim and rotary_dim % 2 == 0, f"rope.dimension_count {rotary_dim} vs head_dim {head_dim}")
        gated = self.arch == "qwen35moe"
        attention = AttentionSpec(
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            rope_base=self.float(Keys.Rope.FREQ_BASE, default=10000.0),
            rotary_dim=rotary_dim,
            gated=gated,
        )

        embd = gf.tensor("token_embd.weight")
        self.check(len(embd.shape) == 2 and embd.shape[1] == n_embd, f"token_embd.weight shape {embd.shape} vs n_embd {n_embd}")
        n_vocab = embd.shape[0]
        tied = "output.weight" not in gf.tensors

        shared_ff = 0
        if self.arch == "qwen35moe":
            shared_ff = self.int(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        moe = MoESpec(
            n_expert=self.int(Keys.LLM.EXPERT_COUNT),
            n_expert_used=self.int(Keys.LLM.EXPERT_USED_COUNT),
            expert_ff=self.int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            shared_ff=shared_ff,
            gating="softmax",
            shared_gate=self.arch == "qwen35moe",
        )
        self.check(moe.n_expert_used <= moe.n_expert, f"expert_used_count {moe.n_expert_used} > expert_count {moe.n_expert}")

        deltanet = None
        kinds = [ATTENTION] * n_layer
        if self.arch == "qwen35moe":
            interval = self.int(Keys.LLM.FULL_ATTENTION_INTERVAL)
            kinds = [ATTENTION if (il + 1) % interval == 0 else DELTANET for il in range(n_layer)]
            deltanet = DeltaNetSpec(
                conv_kernel=self.int(Keys.SSM.CONV_KERNEL),
                state_size=self.int(Keys.SSM.STATE_SIZE),
                n_k_heads=self.int(Keys.SSM.GROUP_COUNT),
                n_v_heads=self.int(Keys.SSM.TIME_STEP_RANK),
                inner_size=self.int(Keys.SSM.INNER_SIZE),
            )
            self.check(deltanet.inner_size % deltanet.n_v_heads == 0, "ssm.inner_size not a multiple of ssm.time_step_rank")
            self.check(deltanet.n_v_heads % deltanet.n_k_heads == 0, "ssm.time_step_rank not a multiple of ssm.group_count")

        spec = ModelSpec(
            path=str(gf.path),
            arch=self.arch,
            name=str(gf.get(Keys.General.NAME, gf.path.stem)),
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            context_length=self.int(Keys.LLM.CONTEXT_LENGTH),
            rms_eps=self.float(Keys.Attention.LAYERNORM_RMS_EPS),
            layer_kinds=tuple(kinds),
            attention=attention,
            moe=moe,
            deltanet=deltanet,
            tied_embeddings=tied,
        )
        self.check_tensor_shapes(spec)
        return spec

    def check_tensor_shapes(self, spec: ModelSpec) -> None:
        """Every tensor the forward pass reads exists, has the shape the hyper-parameters imply, and has
        a type we can decode: refused at load, not half-way through a generation."""
        for name, shape in expected_tensor_shapes(spec).items():
            info = self.gf.tensor(name)
            if info.shape != shape:
                raise ModelFileError(f"{self.gf.path}: tensor {name} has shape {info.shape}, expected {shape}")
            try:
                quants.require_format(info.qtype, name)
            except UnsupportedQuantType as e:
                raise UnsupportedQuantType(f"{self.gf.path}: {e}") from None


def expected_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Numpy-order shapes of every tensor the forward pass of `spec` reads."""
    D, V = spec.n_embd, spec.n_vocab
    a, m = spec.attention, spec.moe
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not spec.tied_embeddings:
        shapes["output.weight"] = (V, D)
    for il, kind in enumerate(spec.layer_kinds):
        p = f"blk.{il}."
        shapes[p + "attn_norm.weight"] = (D,)
        post_norm = "post_attention_norm" if spec.arch == "qwen35moe" else "ffn_norm"
        shapes[p + post_norm + ".weight"] = (D,)
        if kind == ATTENTION:
            q_rows = a.n_head * a.head_dim * (2 if a.gated else 1)
            shapes[p + "attn_q.weight"] = (q_rows, D)
            shapes[p + "attn_k.weight"] = (a.n_head_kv * a.head_dim, D)
            shapes[p + "attn_v.weight"] = (a.n_head_kv * a.head_dim, D)
            shapes[p + "attn_output.weight"] = (D, a.n_head * a.head_dim)
            shapes[p + "attn_q_norm.weight"] = (a.head_dim,)
            shapes[p + "attn_k_norm.weight"] = (a.head_dim,)
        else:
            dn = spec.deltanet
            assert dn is not None  # DELTANET layers exist only when the spec has a DeltaNetSpec
            shapes[p + "attn_qkv.weight"] = (dn.conv_channels, D)
            shapes[p + "attn_gate.weight"] = (dn.inner_size, D)
            shapes[p + "ssm_conv1d.weight"] = (dn.conv_channels, dn.conv_kernel)
            shapes[p + "ssm_dt.bias"] = (dn.n_v_heads,)
            shapes[p + "ssm_a"] = (dn.n_v_heads,)
            shapes[p + "ssm_beta.weight"] = (dn.n_v_heads, D)
            shapes[p + "ssm_alpha.weight"] = (dn.n_v_heads, D)
            shapes[p + "ssm_norm.weight"] = (dn.v_head_dim,)
            shapes[p + "ssm_out.weight"] = (D, dn.inner_size)
        shapes[p + "ffn_gate_inp.weight"] = (m.n_expert, D)
        shapes[p + "ffn_gate_exps.weight"] = (m.n_expert, m.expert_ff, D)
        shapes[p + "ffn_up_exps.weight"] = (m.n_expert, m.expert_ff, D)
        shapes[p + "ffn_down_exps.weight"] = (m.n_expert, D, m.expert_ff)
        if m.shared_ff:
            shapes[p + "ffn_gate_shexp.weight"] = (m.shared_ff, D)
            shapes[p + "ffn_up_shexp.weight"] = (m.shared_ff, D)
            shapes[p + "ffn_down_shexp.weight"] = (D, m.shared_ff)
        if m.shared_gate:
            shapes[p + "ffn_gate_inp_shexp.weight"] = (D,)
    return shapes
