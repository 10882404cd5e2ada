"""The forward pass: embed → layers (one function per architecture) → norm → output head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.qwen3moe import qwen3moe_layer
from fomoepy.model.qwen35moe import qwen35moe_layer
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState
from fomoepy.model.weights import ResidentWeights
from fomoepy.scheduler import Placement, relay
from fomoepy.timing import LayerTimer

LAYER_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "qwen3moe": qwen3moe_layer,
    "qwen35moe": qwen35moe_layer,
}


class Transformer:
    """`ops` is one backend, or one per device with `placement` saying which owns each layer; `weights`
    were loaded onto those devices (load_weights), `experts` compute the routed experts."""

    def __init__(self, spec: ModelSpec, weights: ResidentWeights, ops: Any, experts: Any,
                 placement: Placement | None = None, timer: LayerTimer | None = None):  # fmt: skip
        self.spec = spec
        self.devices = list(ops) if isinstance(ops, (list, tuple)) else [ops]
        self.placement = placement or Placement.single(spec.n_layer)
        if self.placement.n_devices != len(self.devices):
            raise ValueError(f"placement over {self.placement.n_devices} devices, got {len(self.devices)} backends")
        self.ops = self.devices[self.placement.device_of_layer[-1]]  # owns the output head
        self.experts = experts
        self.weights = weights
        self.layer_fn = LAYER_FUNCTIONS[spec.arch]
        self.timer = timer

    def layer_ops(self, il: int) -> Any:
        return self.devices[self.placement.device_of_layer[il]]

    def forward(self, tokens: np.ndarray, state: InferenceState, all_logits: bool = True, logits_from: int = 0) -> np.ndarray:
        """Evaluate `tokens` after the state's past; logits [T - logits_from, V] of rows logits_from.. (or
        [1, V] for the last token). Rows no one reads skip the output head, the largest dense product (a
        perplexity run scores the second half of each chunk)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, self.spec.n_vocab), np.float32)
        bad = tokens[(tokens < 0) | (tokens >= self.spec.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside the vocabulary [0, {self.spec.n_vocab})")
        state.reserve(len(tokens))
        ops, w = self.ops, self.weights
        x = self.weights.embedding(tokens)  # [T, D], on the device that owns the embedding (the head's)
        self.experts.begin_step()
        here = self.ops
        for il in range(self.spec.n_layer):
            owner = self.layer_ops(il)
            if owner is not here:  # the hidden state moves to the device that owns this layer
                x, here = relay(x, here, owner), owner
            if self.timer is None:
                x = self.layer_fn(self, il, x, state)
            else:
                with self.timer.layer(il):
                    x = self.layer_fn(self, il, x, state)
        self.experts.end_step(len(tokens))
        state.n_past += len(tokens)
        state.tokens.extend(tokens.tolist())
        if not all_logits:
            x = x[-1:]
        elif logits_from:
            x = x[logits_from:]
            if not len(x):
                return np.zeros((0, self.spec.n_vocab), np.float32)
        return ops.linear(ops.rms_norm(x, w["output_norm.weight"], self.spec.rms_eps), w["output.weight"])


def load_weights(gf: GGUFFile, spec: ModelSpec, ops: Any, placement: Placement | None = None) -> ResidentWeights:
    """The resident (non-expert) weights, each on the device that owns it under `placement`."""
    devices = list(ops) if isinstance(ops, (list, tuple)) else [ops]
    placement = placement or Placement.single(spec.n_layer)
    return ResidentWeights(gf, spec, lambda name: devices[placement.device_of_tensor(name)])
