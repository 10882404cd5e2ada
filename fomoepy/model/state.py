"""Per-sequence inference state: the KV cache of attention layers and the recurrent state of DeltaNet layers.

A KV cache holds what its sequence uses, not the whole context: it starts at KV_CHUNK positions and
grows by whole chunks (capped at n_ctx) before a step that would overflow it. So a daemon's many
sequences take memory for their own lengths, and `kv_nbytes` says what a given length costs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.model.spec import ATTENTION, ModelSpec


class ContextFullError(FomoeError):
    """The sequence would grow past the context the state was created with."""


KV_CHUNK = 256  # positions a KV cache grows by: one copy per 256 tokens, at most 255 positions unused


@dataclass
class KVCache:
    k: np.ndarray  # [capacity, Hkv, hd], capacity a multiple of KV_CHUNK (or n_ctx) >= the sequence's length
    v: np.ndarray  # [capacity, Hkv, hd]
    # where k's and v's data begin, for a backend whose graphs take addresses (fomoepy.runtime.ggml_attention);
    # None until one asks, and again when the arrays are replaced
    addresses: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def capacity(self) -> int:
        return int(self.k.shape[0])

    def grow(self, capacity: int, n_kept: int, zeros) -> None:
        """Larger arrays of `capacity` positions holding the first n_kept positions of the old ones."""
        shape = (capacity, *self.k.shape[1:])
        k, v = kv_zeros(zeros, shape), kv_zeros(zeros, shape, values=True)
        if n_kept:
            k[:n_kept] = self.k[:n_kept]
            v[:n_kept] = self.v[:n_kept]
        self.k, self.v = k, v
        self.addresses = None


def kv_zeros(zeros, shape: tuple[int, int, int], values: bool = False):
    """A zeroed [capacity, Hkv, hd] KV array (keys, or values) from a device's allocator. An allocator
    with a layout of its own says so by a `kv(shape, values)` method (the cpu backend's: its attention
    graphs read values position by position, fomoepy.runtime.ggml_attention). Otherwise numpy's memory
    is laid out head by head ([Hkv, capacity, hd], seen through a transposed view of the same shape), so
    that attention reads each head's keys and values as one stretch: a decode row's attention on the
    bench shape, caches cold, 95 µs against 150 position by position (the same products: the same bits)."""
    layout = getattr(zeros, "kv", None)
    if layout is not None:
        return layout(shape, values)
    if zeros is np.zeros:
        capacity, heads, dim = shape
        return np.zeros((heads, capacity, dim), np.float32).transpose(1, 0, 2)
    return zeros(shape, np.float32)


@dataclass
class DeltaNetState:
    conv: np.ndarray  # [K-1, conv_channels]: the last K-1 inputs of the causal convolution
    ssm: np.ndarray  # [Hv, dk, dv]: the delta-rule memory S


_SEQUENCES = itertools.count()


@dataclass
class InferenceState:
    n_ctx: int
    layers: list[KVCache | DeltaNetState]
    n_past: int = 0
    tokens: list[int] = field(default_factory=list)  # every token evaluated so far, in order
    allocators: list = field(default_factory=list)  # per layer: zeros(shape, dtype) of its device
    # which sequence this is, for what the cache learns per sequence (a batched step's rows differ)
    sequence: int = field(default_factory=lambda: next(_SEQUENCES))
    # positions every KV cache holds now (reserve's: a decode step that needs no growth asks no layer)
    _held: int = field(default=0, init=False, repr=False, compare=False)

    @classmethod
    def new(cls, spec: ModelSpec, n_ctx: int, zeros=np.zeros, zeros_of_layer=None) -> InferenceState:
        """zeros(shape, dtype) allocates on the backend (numpy here; device memory on a GPU);
        zeros_of_layer(il) gives the allocator of the device that owns layer il."""
        a, dn = spec.attention, spec.deltanet
        layers: list[KVCache | DeltaNetState] = []
        allocators = []
        for il, kind in enumerate(spec.layer_kinds):
            if zeros_of_layer is not None:
                zeros = zeros_of_layer(il)
            allocators.append(zeros)
            if kind == ATTENTION:
                shape = (min(KV_CHUNK, n_ctx), a.n_head_kv, a.head_dim)
                layers.append(KVCache(kv_zeros(zeros, shape), kv_zeros(zeros, shape, values=True)))
            else:
                assert dn is not None  # the spec has DELTANET layers only with a DeltaNetSpec
                layers.append(
                    DeltaNetState(
                        conv=zeros((dn.conv_kernel - 1, dn.conv_channels), np.float32),
                        ssm=zeros((dn.n_v_heads, dn.state_size, dn.v_head_dim), np.float32),
                    )
                )
        return cls(n_ctx=n_ctx, layers=layers, allocators=allocators)

    def reserve(self, n_new: int) -> None:
        """Room for n_new more tokens: raise before any layer is touched, so a refused batch leaves the
        state as it was; else grow every KV cache to hold them (whole chunks, at most n_ctx)."""
        self.check_room(n_new)
        need = self.n_past + n_new
        if need <= self._held:
            return
        capacity = min(self.n_ctx, -(-need // KV_CHUNK) * KV_CHUNK)
        for layer, zeros in zip(self.layers, self.allocators):
            if isinstance(layer, KVCache) and layer.capacity < need:
                layer.grow(capacity, self.n_past, zeros)
        self._held = min((layer.capacity for layer in self.layers if isinstance(layer, KVCache)), default=self.n_ctx)

    def check_room(self, n_new: int) -> None:
        if self.n_past + n_new > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} tokens + {n_new} new exceed the context of {self.n_ctx}"
            )

    @property
    def kv_capacity(self) -> int:
        """Positions the KV caches hold now (0 without attention layers)."""
        return next((layer.capacity for layer in self.layers if isinstance(layer, KVCache)), 0)

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (KV caches only: recurrent states cannot rewind)."""
        if any(isinstance(layer, DeltaNetState) for layer in self.layers) and n != self.n_past:
            raise FomoeError("cannot rewind a recurrent (DeltaNet) state; start a new sequence")
        self.n_past = n
        del self.tokens[n:]


def kv_nbytes(spec: ModelSpec, n_tokens: int) -> int:
    """Bytes of one sequence's state when its KV caches hold n_tokens positions: float32 keys and
    values of every attention layer, plus the fixed-size DeltaNet states."""
    a, dn = spec.attention, spec.deltanet
    n_attention = spec.layer_kinds.count(ATTENTION)
    fixed = 0
    if dn is not None:
        per_layer = (dn.conv_kernel - 1) * dn.conv_channels + dn.n_v_heads * dn.state_size * dn.v_head_dim
        fixed = 4 * per_layer * (len(spec.layer_kinds) - n_attention)
    return 2 * 4 * n_attention * a.n_head_kv * a.head_dim * n_tokens + fixed


def kv_positions(n_tokens: int, n_ctx: int) -> int:
    """Positions a KV cache holds once a sequence reaches n_tokens (whole chunks, at most n_ctx)."""
    return min(n_ctx, max(1, -(-n_tokens // KV_CHUNK)) * KV_CHUNK)
