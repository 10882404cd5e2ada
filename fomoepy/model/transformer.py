"""The forward pass: embed → layers (one function per architecture) → norm → output head.

`forward` evaluates tokens of one sequence; `forward_batch` one new token of each of several
sequences in one step: their dense products and the MoE half run on all rows at once (each selected
expert is read and computed once for every row that picked it), attention and DeltaNet per sequence;
`forward_prompts` prompt chunks of several sequences in one pass: everything per sequence as alone but
the routed experts' step, one for all (each selected expert read once, each chunk's rows computed apart).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.device import Phase
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.moe import kept_rows, moe_ffn_runs
from fomoepy.model.qwen3moe import qwen3moe_layer, qwen3moe_mix
from fomoepy.model.qwen35moe import qwen35moe_layer, qwen35moe_mix
from fomoepy.model.rows import RowwiseOps, Segment, supports_rows
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState
from fomoepy.model.weights import ResidentWeights
from fomoepy.scheduler import Placement, relay
from fomoepy.timing import LayerTimer

LAYER_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "qwen3moe": qwen3moe_layer,
    "qwen35moe": qwen35moe_layer,
}
# each layer function's first half (its mixer, up to the MoE half's input): a joint prefill runs it per
# sequence, then the MoE half for all of them at once
LAYER_MIXERS: dict[str, Callable[..., Any]] = {
    "qwen3moe": qwen3moe_mix,
    "qwen35moe": qwen35moe_mix,
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
        self.mix_fn = LAYER_MIXERS[spec.arch]
        self.timer = timer
        # a step over several sequences needs products whose rows are independent (fomoepy.model.rows)
        self.batches = all(supports_rows(d) for d in self.devices)
        self._rowwise = [RowwiseOps(d) if supports_rows(d) else d for d in self.devices]
        self._kept_layers: tuple | None = None  # (the MoE step, its layers for a one-graph pass): _graph_layers

    def layer_ops(self, il: int, rowwise: bool = False) -> Any:
        """The backend that owns layer il; rowwise: its products give each row the bits it gets alone."""
        device = self.placement.device_of_layer[il]
        return self._rowwise[device] if rowwise else self.devices[device]

    def forward(self, tokens: np.ndarray, state: InferenceState, all_logits: bool = True, phase: Phase = Phase.PREFILL,
                logits_from: int = 0) -> np.ndarray:  # fmt: skip
        """Evaluate `tokens` after the state's past; logits [T - logits_from, V] of rows logits_from.. (or
        [1, V] for the last token). `phase` says what the caller is doing (a decode step predicts and
        prefetches the next layer's experts). Rows no one reads skip the output head, the largest dense
        product (a perplexity run scores the second half of each chunk)."""
        tokens = self._checked(tokens)
        if tokens.size == 0:
            return np.zeros((0, self.spec.n_vocab), np.float32)
        state.reserve(len(tokens))
        if len(tokens) == 1 and not logits_from:
            logits = self._in_one_call(tokens, state, phase)
            if logits is not None:
                return logits
        n = len(tokens)
        if all_logits and logits_from >= n:  # no row is read: the pass still runs, for the state
            self._layers(tokens, [Segment(state, 0, n)], phase, read=slice(n - 1, n))
            return np.zeros((0, self.spec.n_vocab), np.float32)
        read = slice(logits_from if all_logits else n - 1, n)
        x = self._layers(tokens, [Segment(state, 0, n)], phase, read=read if read.start else None)
        return self._head(x, rowwise=False)

    def forward_batch(self, tokens: np.ndarray, states: list[InferenceState]) -> np.ndarray:
        """One new token per sequence: tokens[i] follows states[i]'s past; logits [B, V], row i of which
        has the bits `forward(tokens[i:i+1], states[i])` gives alone (the MoE half's own products aside:
        see fomoepy.model.rows). The states must be distinct."""
        tokens = self._checked(tokens)
        if len(tokens) != len(states):
            raise ValueError(f"{len(tokens)} tokens for {len(states)} sequences")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a sequence appears twice in one batched step")
        if len(states) == 1:
            return self.forward(tokens, states[0], all_logits=False, phase=Phase.DECODE)
        if not self.batches:
            raise FomoeError("this backend cannot decode several sequences in one step (its products are not row-independent)")
        for s in states:  # a full context refuses the step before any state grows
            if s.n_past + 1 > s.n_ctx:
                s.reserve(1)
        for s in states:
            s.reserve(1)
        logits = self._batch_in_one_call(tokens, states)
        if logits is not None:
            return logits
        x = self._layers(tokens, [Segment(s, i, 1) for i, s in enumerate(states)], Phase.DECODE)
        return self._head(x, rowwise=True)

    @property
    def prefills_jointly(self) -> bool:
        """Whether forward_prompts can evaluate several sequences' prompt chunks in one pass: one device,
        whose MoE step computes a step's rows in runs (fomoepy.experts.step.MoEStep)."""
        return len(self.devices) == 1 and getattr(self.experts.device, "computes_runs", False)

    def forward_prompts(self, chunks: list[tuple[np.ndarray, InferenceState]]) -> list[np.ndarray]:
        """Prompt chunks of several sequences in one pass, each chunk after its state's past: the logits
        [1, V] of each chunk's last token, each with the bits `forward(tokens, state, all_logits=False)`
        gives it alone. Each layer's mixer and each chunk's products run per sequence, exactly as alone; the
        MoE half is one step for all (each selected expert planned and read once for every chunk that
        picked it, each chunk's rows computed apart: moe_ffn_runs). So prompts that arrive together share
        their expert reads. Each chunk has at least 2 tokens (a lone token is a decode step's path), the
        states are distinct, and a full context refuses the pass before any state grows."""
        if not self.prefills_jointly:
            raise FomoeError("this backend cannot evaluate several prompts in one pass")
        chunks = [(self._checked(t), s) for t, s in chunks]
        if any(len(t) < 2 for t, _ in chunks):
            raise ValueError("a joint prefill takes chunks of at least 2 tokens")
        if len({id(s) for _, s in chunks}) != len(chunks):
            raise ValueError("a sequence appears twice in one joint prefill")
        for t, s in chunks:
            s.check_room(len(t))
        for t, s in chunks:
            s.reserve(len(t))
        w, L = self.weights, self.spec.n_layer
        own = [[Segment(s, 0, len(t))] for t, s in chunks]  # each chunk's pass, as alone
        xs = [w.embedding(t) for t, _ in chunks]
        self.experts.begin_step(Phase.PREFILL, [s.sequence for t, s in chunks for _ in range(len(t))])
        last = [slice(len(t) - 1, len(t)) for t, _ in chunks]  # (the last layer's MoE half: the rows read)
        for il in range(L):
            kept = last if il == L - 1 else None
            if self.timer is None:
                xs = self._joint_layer(il, xs, own, kept)
            else:
                with self.timer.layer(il):
                    xs = self._joint_layer(il, xs, own, kept)
        self.experts.end_step(sum(len(t) for t, _ in chunks))
        for t, s in chunks:
            s.n_past += len(t)
            s.tokens.extend(t.tolist())
        return [self._head(x, rowwise=False) for x in xs]

    def _joint_layer(self, il: int, xs: list, own: list[list[Segment]], kept: list[slice] | None) -> list:
        """One layer of forward_prompts: each chunk's mixer, then the MoE half of all of them (of the rows
        `kept` of each, where given)."""
        mixed = [self.mix_fn(self, il, x, segments) for x, segments in zip(xs, own)]
        ops, w = self.layer_ops(il), self.weights.layer(il)
        outs = moe_ffn_runs(ops, w, self.spec.moe, self.experts, il, [h for _, h, _ in mixed], [r for _, _, r in mixed], kept)
        ks = kept or [None] * len(xs)
        return [kept_rows(x, k) + out for (x, _, _), out, k in zip(mixed, outs, ks)]

    def _batch_in_one_call(self, tokens: np.ndarray, states: list[InferenceState]) -> np.ndarray | None:
        """A decode row of each sequence through every layer and the head in one call (ops.decode_batch:
        the cpu backend's one graph), where a lone row's would be one (_one_graph_layers); the MoE steps'
        bookkeeping follows (experts.computed_pass). None where it cannot: the layer-by-layer pass then runs."""
        decode_batch = getattr(self.ops, "decode_batch", None)
        layers = self._one_graph_layers() if decode_batch is not None else None
        if layers is None:
            return None
        spec, w = self.spec, self.weights
        self.experts.begin_step(Phase.DECODE, [s.sequence for s in states])
        logits, routing = decode_batch(w.embedding(tokens), layers, [s.layers for s in states], spec.attention, spec.rms_eps,
                                        w["output_norm.weight"], w["output.weight"], [s.n_past for s in states],
                                        spec.moe.n_expert_used)  # fmt: skip
        self._one_call_done(routing, tokens, states)
        return logits

    def _one_call_done(self, routing: tuple, tokens: np.ndarray, states: list[InferenceState]) -> None:
        """After a pass in one call: the MoE steps' bookkeeping of every layer's routing (ids, weights, probs,
        each [L, B, ...]: experts.computed_pass), and each sequence one token further on."""
        self.experts.computed_pass(*routing)
        self.experts.end_step(len(states))
        for s, token in zip(states, tokens.tolist()):
            s.n_past += 1
            s.tokens.append(token)

    def _in_one_call(self, tokens: np.ndarray, state: InferenceState, phase: Phase) -> np.ndarray | None:
        """A lone row's whole pass (every layer and the head) in one call of a backend that computes it as
        one graph (ops.decode_token: the cpu backend's), where the model's layers are its kind (qwen3moe
        on one device, softmax routing, no shared expert) and every layer's experts can be computed in
        it (experts.in_graph: all resident); the MoE steps' bookkeeping follows (experts.computed_pass).
        None where it cannot: the layer-by-layer pass then runs."""
        decode_token = getattr(self.ops, "decode_token", None)
        layers = self._one_graph_layers() if decode_token is not None else None
        if layers is None:
            return None
        spec, m, w = self.spec, self.spec.moe, self.weights
        self.experts.begin_step(phase, [state.sequence])
        logits, routing = decode_token(int(tokens[0]), w.embedding, layers, state.layers, spec.attention, spec.rms_eps,
                                        w["output_norm.weight"], w["output.weight"], state.n_past, m.n_expert_used)  # fmt: skip
        self._one_call_done(routing, tokens, [state])
        return logits

    def _one_graph_layers(self) -> list | None:
        """The layers for a pass as one graph of the backend's (_graph_layers), where the model's layers are
        its kind (qwen3moe on one device, softmax routing, no shared expert, no step records asked for) and
        every layer's experts can be computed in it (experts.in_graph: all resident); else None."""
        ops, spec, m = self.ops, self.spec, self.spec.moe
        if (self.timer is not None or len(self.devices) != 1 or spec.arch != "qwen3moe" or m.shared_ff
                or not ops.fuses_attention(spec.attention, m.gating)):  # fmt: skip
            return None
        layers = self._graph_layers()
        if layers is None or self.experts.in_graph(0) is None:  # (a step record may have been asked for since)
            return None
        return layers

    def _graph_layers(self) -> list | None:
        """Each layer's (weights, its experts' graph inputs: experts.in_graph), one list kept while the same
        MoE step serves the model (its tier, whole, does not change; a reset makes another step; the
        backend keeps its graphs by the list), or None where a layer's experts cannot be computed in the
        backend's graph."""
        kept = self._kept_layers
        if kept is None or kept[0] is not self.experts:
            experts = [self.experts.in_graph(il) for il in range(self.spec.n_layer)]
            layers = None if any(e is None for e in experts) else [(self.weights.layer(il), e) for il, e in enumerate(experts)]
            kept = self._kept_layers = (self.experts, layers)
        return kept[1]

    def _checked(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 1:  # a decode step: one comparison in Python, not four array operations
            if 0 <= int(tokens[0]) < self.spec.n_vocab:
                return tokens
        bad = tokens[(tokens < 0) | (tokens >= self.spec.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside the vocabulary [0, {self.spec.n_vocab})")
        return tokens

    def _layers(self, tokens: np.ndarray, segments: list[Segment], phase: Phase, read: slice | None = None) -> Any:
        """The hidden state after the last layer: [N, D], or of the rows `read` only. The last layer's mixer
        runs on every row (its KV cache or DeltaNet state takes them all); its MoE half, on the rows read
        (as llama.cpp drops the rows it outputs no logits for), the router on every row (usage counts,
        the trace and a profile count every token's choice)."""
        x = self.weights.embedding(tokens)  # [N, D], on the device that owns the embedding (the head's)
        rows = [s.state.sequence for s in segments for _ in range(s.n)]  # each row's sequence
        self.experts.begin_step(phase, rows)
        here = self.ops
        for il in range(self.spec.n_layer):
            owner = self.layer_ops(il)
            if owner is not here:  # the hidden state moves to the device that owns this layer
                x, here = relay(x, here, owner), owner
            kept = read if il == self.spec.n_layer - 1 else None
            if self.timer is None:
                x = self.layer_fn(self, il, x, segments, kept)
            else:
                with self.timer.layer(il):
                    x = self.layer_fn(self, il, x, segments, kept)
        self.experts.end_step(len(tokens))
        for s in segments:
            s.state.n_past += s.n
            s.state.tokens.extend(tokens[s.start : s.start + s.n].tolist())
        return x

    def _head(self, x, rowwise: bool) -> np.ndarray:
        ops, w = self.ops, self.weights
        head = self._rowwise[self.placement.device_of_layer[-1]] if rowwise else ops
        return head.linear(ops.rms_norm(x, w["output_norm.weight"], self.spec.rms_eps), w["output.weight"])


def load_weights(gf: GGUFFile, spec: ModelSpec, ops: Any, placement: Placement | None = None) -> ResidentWeights:
    """The resident (non-expert) weights, each on the device that owns it under `placement`."""
    devices = list(ops) if isinstance(ops, (list, tuple)) else [ops]
    placement = placement or Placement.single(spec.n_layer)
    return ResidentWeights(gf, spec, lambda name: devices[placement.device_of_tensor(name)])
