"""Real MoE model shapes at named quant mixes; every byte count comes from fomoepy.quants.

A shape gives the bytes the time model needs: one routed expert of each layer (gate | up | down, the
store's stride), the dense weights of a layer that stay resident (attention, router, shared
expert), and the output head. Attention is counted as standard (optionally gated-query) attention in
every layer: Qwen3.5's linear-attention layers have about the same weight bytes, and only bytes
matter for a decode step that reads every weight once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from fomoepy.errors import FomoeError
from fomoepy.quants import row_nbytes


@dataclass(frozen=True)
class QuantMix:
    """Tensor type per role, e.g. llama.cpp's Q4_K_M as the published GGUFs of these models use it."""

    name: str
    expert_gate_up: Q
    expert_down: Q
    attn: Q
    attn_v: Q
    shared: Q
    router: Q
    output: Q


MIXES = {
    "Q4_K_M": QuantMix("Q4_K_M", Q.Q4_K, Q.Q5_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.F32, Q.Q6_K),
    "Q8_0": QuantMix("Q8_0", Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.F32, Q.Q8_0),
    # gpt-oss ships its experts in MXFP4 and the rest in 8 bits
    "MXFP4": QuantMix("MXFP4", Q.MXFP4, Q.MXFP4, Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.F32, Q.Q8_0),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    expert_ff: int
    shared_ff: int  # 0: no shared expert
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int
    gated_q: bool = False  # Qwen3.5: attn_q also produces the output gate
    default_mix: str = "Q4_K_M"


SHAPES = {
    s.name: s
    for s in (
        ModelShape("qwen3.5-397b-a17b", 60, 512, 10, 4096, 1024, 1024, 32, 2, 256, 248320, gated_q=True),
        ModelShape("qwen3-235b-a22b", 94, 128, 8, 4096, 1536, 0, 64, 4, 128, 151936),
        ModelShape("qwen3-30b-a3b", 48, 128, 8, 2048, 768, 0, 32, 4, 128, 151936),
        ModelShape("gpt-oss-120b", 36, 128, 4, 2880, 2880, 0, 64, 8, 64, 201088, default_mix="MXFP4"),
    )
}


def _matrix(qtype: Q, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight stored row by row (cols along the quant blocks)."""
    return rows * row_nbytes(qtype, cols)


@dataclass(frozen=True)
class ModelBytes:
    """What one decoded token reads, per layer; every layer alike for these shapes."""

    name: str
    mix: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: int  # one routed expert: gate | up | down
    dense_layer_bytes: int  # attention + router + shared expert of one layer
    head_bytes: int  # output head (read once per token)
    embed_bytes: int  # token embeddings (resident, one row read per token)
    expert_flops: int  # multiply-adds x 2 of one expert for one token
    dense_flops: int = 0  # multiply-adds x 2 of a layer's dense matrices for one token
    head_flops: int = 0  # multiply-adds x 2 of the output head for one token
    router_bytes: int = 0  # of dense_layer_bytes, the router's (a prediction of the next layer reads it again)

    @property
    def store_bytes(self) -> int:
        return self.expert_bytes * self.n_expert * self.n_layer

    @property
    def resident_bytes(self) -> int:
        """Everything that is not a routed expert: stays on the device."""
        return self.dense_layer_bytes * self.n_layer + self.head_bytes + self.embed_bytes


def model_bytes(shape: ModelShape, mix_name: str | None = None) -> ModelBytes:
    mix_name = mix_name or shape.default_mix
    mix = MIXES.get(mix_name)
    if mix is None:
        raise FomoeError(f"unknown quant mix {mix_name!r}; expected one of {', '.join(MIXES)}")
    e, f = shape.n_embd, shape.expert_ff
    try:
        # gate, up: [ff, n_embd]; down: [n_embd, ff] (rows x quantised columns, as in the GGUF)
        expert = 2 * _matrix(mix.expert_gate_up, f, e) + _matrix(mix.expert_down, e, f)
        q_dim, kv_dim = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
        q_rows = q_dim * (2 if shape.gated_q else 1)
        attn = (
            _matrix(mix.attn, q_rows, e)
            + _matrix(mix.attn, kv_dim, e)
            + _matrix(mix.attn_v, kv_dim, e)
            + _matrix(mix.attn, e, q_dim)
        )
        sf = shape.shared_ff
        shared = (2 * _matrix(mix.shared, sf, e) + _matrix(mix.shared, e, sf)) if sf else 0
        router = _matrix(mix.router, shape.n_expert, e)
        head = _matrix(mix.output, shape.vocab, e)
        embed = _matrix(mix.attn, shape.vocab, e)
    except ValueError as exc:  # a row length the mix's block size does not divide
        raise FomoeError(f"{shape.name} at {mix_name}: {exc}") from None
    return ModelBytes(
        name=shape.name,
        mix=mix_name,
        n_layer=shape.n_layer,
        n_expert=shape.n_expert,
        n_expert_used=shape.n_expert_used,
        expert_bytes=expert,
        dense_layer_bytes=attn + shared + router,
        head_bytes=head,
        embed_bytes=embed,
        expert_flops=2 * 3 * e * f,
        dense_flops=2 * e * (q_rows + 2 * kv_dim + q_dim + 3 * shape.shared_ff + shape.n_expert),
        head_flops=2 * shape.vocab * e,
        router_bytes=router,
    )


def shape_by_name(name: str) -> ModelShape:
    shape = SHAPES.get(name.lower())
    if shape is None:
        raise FomoeError(f"unknown model shape {name!r}; expected one of {', '.join(SHAPES)}")
    return shape


def model_bytes_from_gguf(path: str) -> ModelBytes:
    """Bytes read from the file itself, tensor by tensor. Layers whose experts differ in size (mixed
    quant types) are averaged: the time model works with one expert size per model."""
    from fomoepy.experts.source import expert_index
    from fomoepy.model.gguf_file import GGUFFile
    from fomoepy.model.spec import ModelSpec

    gf = GGUFFile(path)
    spec = ModelSpec.from_gguf(gf)
    layers = expert_index(gf, spec)
    expert_tensors = {p.tensor for layer in layers for p in layer.parts}
    dense_tensors = [t for name, t in gf.tensors.items() if name.startswith("blk.") and name not in expert_tensors]
    dense = sum(t.nbytes for t in dense_tensors)
    dense_params = sum(t.shape[0] * t.shape[1] for t in dense_tensors if len(t.shape) == 2)
    head = gf.tensors.get("output.weight") or gf.tensors["token_embd.weight"]  # tied embeddings
    embed = gf.tensors["token_embd.weight"]
    e, (gate, up, down) = spec.moe, layers[0].parts
    return ModelBytes(
        name=Path(path).name,
        mix="as stored",
        n_layer=len(layers),
        n_expert=e.n_expert,
        n_expert_used=e.n_expert_used,
        expert_bytes=round(sum(layer.expert_nbytes for layer in layers) / len(layers)),
        dense_layer_bytes=round(dense / spec.n_layer),
        head_bytes=head.nbytes,
        embed_bytes=embed.nbytes,
        expert_flops=2 * (gate.shape[0] * gate.shape[1] + up.shape[0] * up.shape[1] + down.shape[0] * down.shape[1]),
        dense_flops=round(2 * dense_params / spec.n_layer),
        head_flops=2 * head.shape[0] * head.shape[1],
        router_bytes=round(sum(t.nbytes for name, t in gf.tensors.items() if name.endswith(".ffn_gate_inp.weight")) / len(layers)),
    )
