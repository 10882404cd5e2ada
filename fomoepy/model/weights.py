"""Resident (non-expert) weights: everything the forward pass reads except the routed experts."""

from __future__ import annotations

from typing import Any

import numpy as np

from fomoepy import quants
from fomoepy.experts.source import EXPERT_PARTS
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec, expected_tensor_shapes


class TokenEmbedding:
    """Rows of token_embd dequantised on demand: a real vocabulary is too large to hold as float32."""

    def __init__(self, gf: GGUFFile, spec: ModelSpec):
        self.info = gf.tensor("token_embd.weight")
        self.table = gf.raw(self.info)
        self.row_bytes = quants.row_nbytes(self.info.qtype, spec.n_embd, self.info.name)  # the type and row checked here
        self.format = quants.require_format(self.info.qtype, self.info.name)
        self.n_embd = spec.n_embd

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        # the rows' blocks straight to the type's decoder (quants.dequantize's checks were made at load):
        # on a decode step, one row, ~36 µs where the checked path took ~117 (cold caches, bench model)
        t = tokens.tolist()
        if len(t) == 1:
            rows = self.table[t[0] * self.row_bytes : (t[0] + 1) * self.row_bytes]
        else:
            rows = np.stack([self.table[i * self.row_bytes : (i + 1) * self.row_bytes] for i in t])
        return self.format.dequantize_blocks(rows.reshape(-1, self.format.type_size)).reshape(len(t), self.n_embd)


class ResidentWeights:
    """Dense weights loaded into the backend once, by their GGUF names."""

    def __init__(self, gf: GGUFFile, spec: ModelSpec, backend: Any):
        """backend: the backend that loads every tensor, or a function name -> backend (placement)."""
        backend_of = backend if callable(backend) and not hasattr(backend, "load_weight") else (lambda name: backend)
        self.embedding = TokenEmbedding(gf, spec)
        self.n_layer = spec.n_layer
        expert_suffixes = tuple(f".{p}.weight" for p in EXPERT_PARTS)
        self.tensors: dict[str, Any] = {}
        for name in expected_tensor_shapes(spec):
            if name == "token_embd.weight" and not spec.tied_embeddings:
                continue
            if name.endswith(expert_suffixes):
                continue
            self.tensors[name] = backend_of(name).load_weight(gf, gf.tensor(name))
        if spec.tied_embeddings:
            self.tensors["output.weight"] = self.tensors.pop("token_embd.weight")
        self.nbytes = sum(getattr(t, "nbytes", 0) for t in self.tensors.values())

    def routers(self) -> list[Any]:
        """Every MoE layer's router, in layer order (the expert executors predict the next layer with them)."""
        return [self.tensors[f"blk.{il}.ffn_gate_inp.weight"] for il in range(self.n_layer)]

    def layer(self, il: int) -> LayerView:
        return LayerView(self.tensors, f"blk.{il}.")

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]


class LayerView:
    """`w.attn_q` for blk.N.attn_q.weight, `w.ssm_a` for blk.N.ssm_a — reads like the model's equations."""

    __slots__ = ("_tensors", "_prefix")

    def __init__(self, tensors: dict[str, Any], prefix: str):
        self._tensors = tensors
        self._prefix = prefix

    def __getattr__(self, short: str) -> Any:
        t = self._tensors
        p = self._prefix
        for name in (f"{p}{short}.weight", f"{p}{short}", f"{p}{short.replace('_bias', '.bias')}"):
            if name in t:
                return t[name]
        raise AttributeError(f"no tensor {p}{short}[.weight]")

    def has(self, short: str) -> bool:
        try:
            getattr(self, short)
        except AttributeError:
            return False
        return True
