"""The forward pass: embed → layers (one function per architecture) → norm → output head."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.qwen35moe import qwen35moe_layer
from fomoepy.model.qwen3moe import qwen3moe_layer
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState
from fomoepy.model.weights import ResidentWeights

LAYER_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "qwen3moe": qwen3moe_layer,
    "qwen35moe": qwen35moe_layer,
}


class Transformer:
    def __init__(self, gf: GGUFFile, spec: ModelSpec, ops: Any, experts: Any):
        self.spec = spec
        self.ops = ops
        self.experts = experts
        self.weights = ResidentWeights(gf, spec, ops)
        self.layer_fn = LAYER_FUNCTIONS[spec.arch]
        experts.routers = [self.weights[f"blk.{il}.ffn_gate_inp.weight"] for il in range(spec.n_layer)]

    def forward(self, tokens: np.ndarray, state: InferenceState, all_logits: bool = True) -> np.ndarray:
        """Evaluate `tokens` after the state's past; logits [T, V] (or [1, V] for the last token)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, self.spec.n_vocab), np.float32)
        bad = tokens[(tokens < 0) | (tokens >= self.spec.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside the vocabulary [0, {self.spec.n_vocab})")
        state.reserve(len(tokens))
        ops, w = self.ops, self.weights
        x = self.weights.embedding(tokens)  # [T, D]
        self.experts.begin_step(state.n_past, len(tokens))
        for il in range(self.spec.n_layer):
            x = self.layer_fn(self, il, x, state)
        self.experts.end_step(len(tokens))
        state.n_past += len(tokens)
        state.tokens.extend(tokens.tolist())
        if not all_logits:
            x = x[-1:]
        return ops.linear(ops.rms_norm(x, w["output_norm.weight"], self.spec.rms_eps), w["output.weight"])
