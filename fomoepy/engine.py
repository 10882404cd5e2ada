"""Engine: one opened model (file, spec, tokenizer, backend, experts) and what can be asked of it.

`logits` scores a token sequence at every position; `generate` streams sampled tokens. Both run
prefill (every prompt token in one batched pass) and then one-token decode steps on an
`InferenceState` that a caller may keep to continue a conversation.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.policy import make_policy, policy_demotes
from fomoepy.experts.source import GGUFExpertSource, LayerExperts
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState
from fomoepy.model.tokenizer import Tokenizer
from fomoepy.model.transformer import Transformer, load_weights
from fomoepy.options import EngineOptions
from fomoepy.runtime.backends import device_expert_nbytes, make_experts, open_backends
from fomoepy.sampling import Sampler, SamplingParams
from fomoepy.scheduler import Placement
from fomoepy.timing import LayerTimer


class Engine:
    def __init__(self, model_path: str | os.PathLike[str], options: EngineOptions = EngineOptions()):
        self.options = options
        self.file = GGUFFile(model_path)
        self.spec = ModelSpec.from_gguf(self.file)
        self.n_ctx = options.n_ctx or self.spec.context_length
        if self.n_ctx < 1:
            raise FomoeError(f"context size must be >= 1, got {self.n_ctx}")
        self.placement = Placement.parse(options.placement, self.spec.n_layer, options.devices)
        self.devices = open_backends(options, self.spec)
        self.ops = self.devices[0]
        if options.store:
            from fomoepy.experts.store_reader import ExpertStore

            self.source = ExpertStore.open(list(options.store), self.file)
        else:
            # --ram-cache bounds the experts' memory: their mapped pages are given back after each use
            self.source = GGUFExpertSource(self.file, self.spec, unmap_after_use=options.ram_cache is not None)
        self.weights = load_weights(self.file, self.spec, self.devices, self.placement)
        self.timer = LayerTimer(self.spec.n_layer) if options.profile_timing else None
        self.experts = self._open_experts()
        self.model = Transformer(self.spec, self.weights, self.devices, self.experts, self.placement, self.timer)

    def _open_experts(self, trace: bool = True):
        o = self.options
        layers = self.source.layers
        demotes = policy_demotes(o.cache_policy)
        device_unit = [device_expert_nbytes(self.ops, layer, demotes) for layer in layers]
        if is_ggml_cpu(self.ops):
            if o.vram_cache:
                raise FomoeError(
                    "--vram-cache must be 0 on the cpu backend: ggml computes from the host tier's quantized "
                    "bytes in place (--backend reference keeps a float32 device tier)"
                )
            device = 0
        else:
            device = o.vram_cache if o.vram_cache is not None else self._default_device_bytes(device_unit)
        host = o.ram_cache if o.ram_cache is not None else default_host_bytes(layers, self.spec, bool(o.store) or o.backfills)
        # --vram-cache, --ram-cache and --cache-policy act here: the tiers' capacities and eviction
        cache = ExpertCache(
            self.spec.moe.n_expert, [layer.expert_nbytes for layer in layers], device, host,
            device_policy=make_policy(o.cache_policy), host_policy=make_policy(o.cache_policy),
            device_expert_bytes=device_unit, device_of_layer=self.placement.device_of_layer,
        )  # fmt: skip
        streamer = ExpertStreamer(self.source, cache, self.spec.moe.n_expert_used, o, self.spec.name, record_trace=trace)
        return make_experts(self.ops, streamer, self.weights.routers(), self.devices, self.placement.device_of_layer, self.timer)

    def _default_device_bytes(self, unit: list[int]) -> int:
        mem_info = getattr(getattr(self.ops, "rt", None), "mem_info", None)
        if mem_info is None:
            return default_device_bytes(unit, self.spec)
        # GPU: what is free now, less the resident weights still to load (their file bytes, twice
        # for dequantised copies), the KV cache of the whole context, and 1 GiB of workspace
        free, _ = mem_info()
        expert_tensors = {p.tensor for layer in self.source.layers for p in layer.parts}
        dense = sum(t.nbytes for name, t in self.file.tensors.items() if name not in expert_tensors)
        a = self.spec.attention
        kv = 2 * self.n_ctx * a.n_head_kv * a.head_dim * 4 * self.spec.layer_kinds.count("attention")
        return max(0, min(sum(unit) * self.spec.moe.n_expert, free - 2 * dense - kv - (1 << 30)))

    def reset_expert_cache(self) -> None:
        """Empty every expert tier (cold-start measurements); traces and counters carry on."""
        old = self.experts
        trace, old.streamer.trace = old.streamer.trace, None  # stays open across the reset
        self._close_experts()
        self.experts = self._open_experts(trace=False)
        self.experts.streamer.carry_over_from(old.streamer, trace)
        self.model.experts = self.experts

    def stats(self) -> dict:
        return self.experts.streamer.stats()

    def stats_lines(self) -> list[str]:
        lines = self.experts.streamer.lines()
        if self.placement.n_devices > 1:
            lines.append(f"placement: {self.placement.n_devices} devices, {self.placement.relays()} relays per token")
        if self.timer is not None:
            lines += ["host time per MoE layer step (µs):", *self.timer.report()]
        return lines

    def _close_experts(self) -> None:
        close = getattr(self.experts, "close", None)
        if close is not None:
            close()
        self.experts.streamer.close()

    def close(self) -> None:
        self._close_experts()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Built on first use: scoring token ids (`fomoe logits`) needs no vocabulary."""
        return Tokenizer.from_metadata(self.file.metadata, str(self.file.path))

    def new_state(self) -> InferenceState:
        owner = self.placement.device_of_layer
        return InferenceState.new(
            self.spec, self.n_ctx, zeros_of_layer=lambda il: getattr(self.devices[owner[il]], "zeros", np.zeros)
        )

    def eval(self, state: InferenceState, tokens: Sequence[int] | np.ndarray, all_logits: bool = False,
             logits_from: int = 0) -> np.ndarray:  # fmt: skip
        """Append tokens to the sequence; logits of every new position from `logits_from` on, or of the last one only."""
        return np.asarray(self.model.forward(np.asarray(tokens, dtype=np.int64), state, all_logits=all_logits, logits_from=logits_from))

    def logits(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [T, n_vocab]: row i scores the token after tokens[0..i], from an empty state."""
        return self.eval(self.new_state(), tokens, all_logits=True)

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: SamplingParams = SamplingParams.greedy(),
        state: InferenceState | None = None,
        stop_at_eog: bool = True,
    ) -> Iterator[int]:
        """Yield up to max_tokens sampled ids after `prompt`; stops after an end-of-generation token.

        The prompt continues `state` when one is given (its past stays), so a chat can keep its cache.
        """
        if max_tokens < 0:
            raise FomoeError(f"max_tokens must be >= 0, got {max_tokens}")
        if not len(prompt):
            raise FomoeError("the prompt is empty: give at least one token")
        state = state if state is not None else self.new_state()
        sampler = Sampler(params)
        history = list(state.tokens) + list(prompt)
        logits = self.eval(state, prompt)[-1]
        eog = set(self.tokenizer.eog_ids)
        for _ in range(max_tokens):
            token = sampler(logits, history)
            yield token
            history.append(token)
            if stop_at_eog and token in eog:
                return
            if state.n_past >= state.n_ctx:
                return
            logits = self.eval(state, [token])[-1]


def is_ggml_cpu(ops) -> bool:
    from fomoepy.runtime.ggml_cpu import GgmlBackend

    return isinstance(ops, GgmlBackend)


def default_device_bytes(unit: list[int], spec: ModelSpec) -> int:
    """Reference backend's device tier: every expert compute-ready if that fits in half the available memory."""
    wanted = sum(unit) * spec.moe.n_expert
    return min(wanted, available_memory_bytes() // 2)


def default_host_bytes(layers: tuple[LayerExperts, ...], spec: ModelSpec, wanted_tier: bool) -> int:
    """DRAM tier: with a store (or a backfill to fill it), every expert if that fits in a quarter of the
    available memory; otherwise the GGUF is memory-mapped and the page cache already plays this part."""
    if not wanted_tier:
        return 0
    wanted = sum(layer.expert_nbytes for layer in layers) * spec.moe.n_expert
    return min(wanted, available_memory_bytes() // 4)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
