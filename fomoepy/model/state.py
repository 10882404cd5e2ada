"""Per-sequence inference state: the KV cache of attention layers and the recurrent state of DeltaNet layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.model.spec import ATTENTION, ModelSpec


class ContextFullError(FomoeError):
    """The sequence would grow past the context the state was created with."""


@dataclass
class KVCache:
    k: np.ndarray  # [n_ctx, Hkv, hd]
    v: np.ndarray  # [n_ctx, Hkv, hd]


@dataclass
class DeltaNetState:
    conv: np.ndarray  # [K-1, conv_channels]: the last K-1 inputs of the causal convolution
    ssm: np.ndarray  # [Hv, dk, dv]: the delta-rule memory S


@dataclass
class InferenceState:
    n_ctx: int
    layers: list[KVCache | DeltaNetState]
    n_past: int = 0
    tokens: list[int] = field(default_factory=list)  # every token evaluated so far, in order

    @classmethod
    def new(cls, spec: ModelSpec, n_ctx: int, zeros=np.zeros, zeros_of_layer=None) -> InferenceState:
        """zeros(shape, dtype) allocates on the backend (numpy here; device memory on a GPU);
        zeros_of_layer(il) gives the allocator of the device that owns layer il."""
        a, dn = spec.attention, spec.deltanet
        layers: list[KVCache | DeltaNetState] = []
        for il, kind in enumerate(spec.layer_kinds):
            if zeros_of_layer is not None:
                zeros = zeros_of_layer(il)
            if kind == ATTENTION:
                shape = (n_ctx, a.n_head_kv, a.head_dim)
                layers.append(KVCache(zeros(shape, np.float32), zeros(shape, np.float32)))
            else:
                assert dn is not None  # the spec has DELTANET layers only with a DeltaNetSpec
                layers.append(
                    DeltaNetState(
                        conv=zeros((dn.conv_kernel - 1, dn.conv_channels), np.float32),
                        ssm=zeros((dn.n_v_heads, dn.state_size, dn.v_head_dim), np.float32),
                    )
                )
        return cls(n_ctx=n_ctx, layers=layers)

    def reserve(self, n_new: int) -> None:
        """Raise before any layer is touched, so a refused batch leaves the state as it was."""
        if self.n_past + n_new > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} tokens + {n_new} new exceed the context of {self.n_ctx}"
            )

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (KV caches only: recurrent states cannot rewind)."""
        if any(isinstance(layer, DeltaNetState) for layer in self.layers) and n != self.n_past:
            raise FomoeError("cannot rewind a recurrent (DeltaNet) state; start a new sequence")
        self.n_past = n
        del self.tokens[n:]
