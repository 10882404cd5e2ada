"""Engine: one opened model (file, spec, tokenizer, backend, experts) and what can be asked of it.

`logits` scores a token sequence at every position; `generate` streams sampled tokens: the prompt
in chunks of at most `prefill_chunk` tokens, then one-token decode steps, on an `InferenceState` that
a caller may keep to continue a conversation. The daemon drives the same steps for many requests
(`start`, `prefill`, `decode`): a decode step evaluates one token of each of several sequences at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.device import Phase
from fomoepy.experts.fast_cache import make_cache
from fomoepy.experts.policy import make_policy, policy_demotes
from fomoepy.experts.resident_step import ResidentStep
from fomoepy.experts.source import GGUFExpertSource, LayerExperts
from fomoepy.experts.step import MoEStep
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.generation import Generation
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState, kv_nbytes, kv_positions
from fomoepy.model.tokenizer import Tokenizer
from fomoepy.model.transformer import Transformer, load_weights
from fomoepy.options import EngineOptions
from fomoepy.outputs import check_output
from fomoepy.runtime import batched_experts
from fomoepy.runtime.available_memory import available_memory_bytes
from fomoepy.runtime.backends import make_expert_device, open_backends
from fomoepy.runtime.heap import return_freed_memory
from fomoepy.runtime.pinned import reserve_bytes
from fomoepy.sampling import SamplingParams
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
        if options.store or options.ram_cache is not None:
            # the model's memory is bounded: what a prefill frees goes back to the OS, not into the page
            # cache's share (fomoepy.runtime.heap)
            return_freed_memory()
        self.devices = open_backends(options, self.spec)
        self.ops = self.devices[0]
        if options.store:
            from fomoepy.experts.store_reader import ExpertStore

            self.source = ExpertStore.open(list(options.store), self.file)
        else:
            # --ram-cache bounds the experts' memory: their mapped pages are given back after each use
            self.source = GGUFExpertSource(self.file, self.spec, unmap_after_use=options.ram_cache is not None)
        self.weights = load_weights(self.file, self.spec, self.devices, self.placement)
        self.timer = LayerTimer(self.spec.n_layer, times_products=is_ggml_cpu(self.ops)) if options.profile_timing else None
        self.device_state_room: int | None = None  # a GPU's bytes for the sequences' states (set with its tier)
        self.experts = self._open_experts()
        self.model = Transformer(self.spec, self.weights, self.devices, self.experts, self.placement, self.timer)

    def _open_experts(self, trace: bool = True) -> MoEStep:
        """The MoE step: its device (the backend's expert executor), the cache over the tiers, the streamer."""
        o = self.options
        layers = self.source.layers
        host = o.ram_cache if o.ram_cache is not None else default_host_bytes(layers, self.spec, bool(o.store) or o.backfills)
        moe = self.spec.moe
        slots = (moe.n_expert, 0, moe.n_expert_used, False, False)
        whole = False  # a cpu tier that holds the whole model
        if is_ggml_cpu(self.ops):
            if o.vram_cache:  # --backend auto fell back to the cpu backend (an explicit cpu is refused by the options)
                raise FomoeError("--vram-cache must be 0 on the cpu backend, which --backend auto chose: no GPU could start")
            # the one tier is ggml's slot tensors in host memory, computed from in place (the cache's device
            # tier), sized by --ram-cache; by default every expert where that fits in half the free memory
            # the dense weights leave (computed from in place, mapped: their pages are not taken yet)
            store_unit = [layer.expert_nbytes for layer in layers]
            device_bytes = o.ram_cache if o.ram_cache is not None else default_device_bytes(store_unit, self.spec, self._dense_bytes())
            host = 0
            # repacked slots compute a decode row faster (bench/moe_layer.py), but each expert set into one is
            # repacked first (~0.36 ms a bench-model expert, three plain sets): worth it once, at load, for a
            # tier that holds every expert; not for every miss of one that streams
            whole = device_bytes >= sum(store_unit) * moe.n_expert
            # fomoepy's batched kernel reads plain slots: where it serves, they stay plain by default. Whatever
            # the thread count (so -t never changes a row's bits): a bench-model layer's experts by hand, this
            # 2-vCPU EPYC, 1 / 8 rows, kernel against ggml's repacked products: 1 thread 0.39 / 2.42 ms against
            # 0.36 / 2.59, 2 threads 0.21 / 1.11 against 0.28 / 2.16
            # (auto: where it was measured, AVX-512; on: its AVX2 form too, not measured on an AVX2-only CPU)
            form = {"auto": batched_experts.AVX512, "on": batched_experts.AVX2}.get(o.expert_kernel)
            kernel = form is not None and batched_experts.serves(layers, form)
            repack = {"on": True, "off": False}.get(o.repack_experts, whole and not kernel)
            slots = (moe.n_expert, device_bytes, moe.n_expert_used, repack, kernel)
        # exclusive tiers need a host tier to demote into; the reference device then keeps store bytes too
        demotes = policy_demotes(o.cache_policy) and host > 0
        device = make_expert_device(self.ops, layers, self.weights.routers(), self.devices, self.placement.device_of_layer, demotes,
                                    slots)  # fmt: skip
        device_unit = [device.expert_nbytes(layer.layer) for layer in layers]
        if not is_ggml_cpu(self.ops):
            free = self._device_free()
            device_bytes = o.vram_cache if o.vram_cache is not None else self._default_device_bytes(device_unit, free)
            # what a GPU has left for the sequences' states (their KV caches and recurrent states live in its
            # memory): the daemon admits a batch within it (fomoepy.serve.worker.default_kv_budget)
            self.device_state_room = None if free is None else max(0, free - device_bytes)
        # --vram-cache, --ram-cache and --cache-policy act here: the tiers' capacities and eviction
        cache = make_cache(
            self.spec.moe.n_expert, [layer.expert_nbytes for layer in layers], device_bytes, host,
            device_policy=make_policy(o.cache_policy), host_policy=make_policy(o.cache_policy),
            device_expert_bytes=device_unit, device_of_layer=self.placement.device_of_layer,
        )  # fmt: skip
        streamer = ExpertStreamer(self.source, cache, self.spec.moe.n_expert_used, o, self.spec.name, record_trace=trace,
                                  download=device.download if device.can_download else None,
                                  buffers=getattr(device, "host_buffer", None),
                                  buffers_anywhere=getattr(device, "host_buffer_anywhere", False),
                                  read_ahead_pays=getattr(device, "read_ahead_pays", None),
                                  plans_beside=getattr(device, "plans_beside", False))  # fmt: skip
        slot_nbytes = getattr(self.source, "slot_nbytes", None)
        if host and slot_nbytes is not None and hasattr(device, "reserve_reads"):
            # the host tier's read buffers (a GPU's pinned memory) taken while the first tokens run, not as
            # the tier fills: each chunk taken then stalled a 397B step for tens of ms
            device.reserve_reads(reserve_bytes(host, [slot_nbytes(il) for il in range(len(layers))]))
        if not whole:  # a whole tier is filled at load and never misses: its steps skip the cache's plans (ResidentStep)
            # the next layer's prediction (its router, computed on every decode step) serves reading ahead
            # and a recorded trace (its accuracy, for `fomoe plan`) only: without either (--no-prefetch, a
            # source with no reads in the background) no step pays for it
            predicts = self.weights.routers() is not None and (streamer.read_ahead is not None or bool(o.trace))
            return MoEStep(streamer, device, predicts=predicts, timer=self.timer)
        step = ResidentStep(streamer, device, timer=self.timer)
        # filled at load (after a profile's seeds, if any), as llama.cpp repacks its weights at load
        seeded = cache.seed([(layer.layer, e) for layer in layers for e in range(moe.n_expert)])[0]
        drop = getattr(self.source, "drop", None)  # a mapped GGUF: its pages back to the page cache
        for layer in layers:
            experts = [e for il, e in seeded if il == layer.layer]
            for e in experts:
                device.install((layer.layer, e), self.source.read(layer.layer, e))
            if drop is not None:
                drop(layer.layer, experts)
        return step

    def _dense_bytes(self) -> int:
        """The GGUF's bytes of every tensor but the routed experts'."""
        expert_tensors = {p.tensor for layer in self.source.layers for p in layer.parts}
        return sum(t.nbytes for name, t in self.file.tensors.items() if name not in expert_tensors)

    def _default_device_bytes(self, unit: list[int], free: int | None) -> int:
        """The device tier's bytes when --vram-cache is not given; free: _device_free's (None: no GPU)."""
        if free is None:
            return default_device_bytes(unit, self.spec)
        # GPU: what is free for the tier (_device_free), less the states of --max-batch sequences (`fomoe
        # serve`'s; one elsewhere) at the whole context: their KV caches and recurrent states
        states = self.options.sequences * kv_nbytes(self.spec, self.n_ctx)
        return max(0, min(sum(unit) * self.spec.moe.n_expert, free - states))

    def _device_free(self) -> int | None:
        """A GPU's memory free now for the device tier and the sequences' states: less the resident weights
        (their file bytes, twice for dequantised copies) and 1 GiB of workspace; None for the CPU backends."""
        mem_info = getattr(getattr(self.ops, "rt", None), "mem_info", None)
        if mem_info is None:
            return None
        free, _ = mem_info()
        return free - 2 * self._dense_bytes() - (1 << 30)

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
        self.experts.close()

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
             phase: Phase = Phase.PREFILL, logits_from: int = 0) -> np.ndarray:  # fmt: skip
        """Append tokens to the sequence; logits of every new position from `logits_from` on, or of the last one only."""
        return np.asarray(self.model.forward(np.asarray(tokens, dtype=np.int64), state, all_logits=all_logits, phase=phase,
                                             logits_from=logits_from))  # fmt: skip

    def decode_token(self, state: InferenceState, token: int) -> np.ndarray:
        """One decode step of one sequence: the logits [V] after `token` (predicting and prefetching each
        next layer's experts), without sampling (benchmarks, traces)."""
        return self.eval(state, [token], phase=Phase.DECODE)[-1]

    def logits(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [T, n_vocab]: row i scores the token after tokens[0..i], from an empty state."""
        return self.eval(self.new_state(), tokens, all_logits=True)

    @property
    def prefill_chunk(self) -> int:
        """Most prompt tokens one prefill step evaluates (a running stream waits at most one such step
        between two of its tokens while a newcomer's prompt is evaluated)."""
        return self.options.prefill_chunk

    @property
    def batches(self) -> bool:
        """Whether one decode step can evaluate several sequences (every device's products give each row
        the bits it gets alone: fomoepy.model.rows)."""
        return self.model.batches

    def kv_nbytes(self, n_tokens: int) -> int:
        """Bytes a sequence's state takes once it holds n_tokens (its KV caches grow by whole chunks)."""
        return kv_nbytes(self.spec, kv_positions(n_tokens, self.n_ctx))

    def start(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams.greedy(),
              state: InferenceState | None = None, stop_at_eog: bool = True) -> Generation:  # fmt: skip
        """A generation of up to max_tokens after `prompt`, continuing `state` when given."""
        return Generation(state if state is not None else self.new_state(), prompt, max_tokens, params,
                          frozenset(self.tokenizer.eog_ids), stop_at_eog)  # fmt: skip

    def prefill(self, gen: Generation) -> int | None:
        """Evaluate the generation's next prompt chunk; after the last one, the first sampled token
        (None while prompt tokens remain, or when max_tokens is 0)."""
        chunk = gen.take_chunk(self.prefill_chunk)
        logits = self.eval(gen.state, chunk)
        return gen.prompt_done(logits[-1]) if not gen.pending else None

    @property
    def prefills_jointly(self) -> bool:
        """Whether prefill_many evaluates several generations' chunks in one pass (sharing their reads)."""
        return self.model.prefills_jointly

    def prefill_many(self, gens: Sequence[Generation]) -> list[int | None]:
        """`prefill` for each generation, their chunks in one pass where the backend can (each chunk with the
        bits it gets alone, the experts they pick read once for all: Transformer.forward_prompts); chunks of
        at least 2 tokens. Each one's first sampled token after its last chunk, else None."""
        if len(gens) == 1 or not self.prefills_jointly:
            return [self.prefill(g) for g in gens]
        if any(min(len(g.pending), self.prefill_chunk) < 2 for g in gens):
            raise FomoeError("a joint prefill takes chunks of at least 2 tokens")
        chunks = [np.asarray(g.take_chunk(self.prefill_chunk), np.int64) for g in gens]
        logits = self.model.forward_prompts([(c, g.state) for c, g in zip(chunks, gens)])
        return [g.prompt_done(np.asarray(row)[-1]) if not g.pending else None for g, row in zip(gens, logits)]

    def decode(self, gens: Sequence[Generation]) -> list[int]:
        """One step for generations in decode: each one's pending token evaluated (all in one batched
        step), and each one's next token sampled."""
        tokens = [g.next_token for g in gens]
        if any(t is None for t in tokens):
            raise FomoeError("expected generations in decode, got one with no token to evaluate")
        logits = self.model.forward_batch(np.asarray(tokens, np.int64), [g.state for g in gens])
        return [g.sampled(np.asarray(row)) for g, row in zip(gens, logits)]

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
        gen = self.start(prompt, max_tokens, params, state, stop_at_eog)
        token = None
        while gen.pending:
            token = self.prefill(gen)
        if token is None:
            return
        yield token
        while not gen.finished:
            yield self.decode([gen])[0]


def is_ggml_cpu(ops) -> bool:
    return ops.experts_kind == "ggml"


def default_device_bytes(unit: list[int], spec: ModelSpec, paged_in: int = 0) -> int:
    """A device tier in host memory (the reference backend's, the cpu backend's one tier): every expert
    if that fits in half the available memory (fomoepy.runtime.available_memory: a memory cgroup's limit
    counts) once `paged_in` bytes, the mapped weights every token reads, have taken theirs."""
    wanted = sum(unit) * spec.moe.n_expert
    return min(wanted, max(0, available_memory_bytes() - paged_in) // 2)


def default_host_bytes(layers: tuple[LayerExperts, ...], spec: ModelSpec, wanted_tier: bool) -> int:
    """DRAM tier: with a store (or a backfill to fill it), every expert if that fits in a quarter of the
    available memory; otherwise the GGUF is memory-mapped and the page cache already plays this part."""
    if not wanted_tier:
        return 0
    wanted = sum(layer.expert_nbytes for layer in layers) * spec.moe.n_expert
    return min(wanted, available_memory_bytes() // 4)


def open_engine(args: argparse.Namespace):
    """An Engine for args.model (the demo model when none is given) with the parsed engine options."""
    options = EngineOptions.from_args(args)  # every flag checked before anything is loaded or written
    if options.trace:
        check_output(options.trace, "--trace")
    if resolve_model(args):  # the demo model: its store was chosen (and prepared) just now
        options = dataclasses.replace(options, store=tuple(args.store))
    return Engine(args.model, options)


def resolve_model(args: argparse.Namespace) -> bool:
    """No MODEL given: use the embedded demo model, reading its experts from a store prepared on
    first use in the user's cache directory. Returns whether the demo model was chosen."""
    if getattr(args, "model", None):
        return False
    from fomoepy.data import demo_model_path, ensure_demo_store

    try:
        path = demo_model_path()
    except FileNotFoundError as e:
        raise FomoeError(f"no MODEL given and the embedded demo model is missing ({e})") from None
    args.model = str(path)
    if not getattr(args, "store", None):
        args.store = [str(ensure_demo_store(path))]
    return True
