"""Routed experts on the ggml CPU backend: the tier's experts in ggml slot tensors, a decode step of a
layer one mul_mat_id product over them, a prefill one product per expert over its tokens
(fomoepy.runtime.ggml_pool, fomoepy.runtime.ggml_slots).

The tier (the cache's device tier: on this backend it is host memory, sized by --ram-cache) holds
experts repacked where ggml has kernels for their type, as llama.cpp holds its weights, when it holds
every expert (filled once, at load); a tier that streams holds them in their store form, as llama.cpp's
--no-repack does (--repack-experts on|off overrides). ggml repacks a Q4_K matrix at ~1.3 GB/s (a
bench-model expert ~0.36 ms, three plain sets), more than the expert's product takes, so repacking every
expert a step streams through cost more than the repacked kernels save: a decode row's products run
10-16 % faster repacked, a prefill's no faster (ggml's repacked mul_mat_id runs a GEMV per row;
`bench/moe_layer.py`). A step's experts the tier does not hold are set into staging slots of the same
pool for the step, so they go through the same kernels: which experts were resident changes the time a
step takes, never its bits (at one slot form). A step's reads land in the device's read arena
(fomoepy.runtime.ggml_reads) where it has room: with plain slots, the misses the tier does not keep are
computed there, in place, with the same kernels, instead of being copied into staging slots first (all
but a long prompt's grouped products, which take each slot's tokens together).
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from fomoepy.experts.device import Phase, StepExperts
from fomoepy.experts.routing import top_ids
from fomoepy.experts.source import LayerExperts
from fomoepy.runtime import batched_experts, ggml_threads
from fomoepy.runtime.ggml_matmul import QuantMatrix, expert_ffn, top_ids_of_product
from fomoepy.runtime.ggml_pool import SlotPool, layout_of
from fomoepy.runtime.ggml_reads import DeviceReads
from fomoepy.runtime.ggml_slots import weighted_sum
from fomoepy.runtime.pinned import contiguous_address

F32 = np.float32
_ONE_THREAD_ROWS = 16  # router rows computed on one thread (a decode step's, of up to 16 sequences)
# Prefill tokens from which a layer's experts run a product per expert over its tokens rather than one
# mul_mat_id over every pick, by slot form and thread count (None: never). `python bench/moe_layer.py
# --threads 1 --tokens 1,64,128,256 --record` and `--threads 2 --tokens 1,128,512,1024 --record` (the
# bench model's layer on llama.cpp's ggml with llamafile, tools/build_ggml.sh; this 2-vCPU EPYC; ms a
# layer, one mul_mat_id against a product per slot):
#   plain, 1 thread:     39.9 / 42.6 at 128, 81.6 / 65.9 at 256 (by hand: 50.2 / 53.5 at 192);
#   plain, 2 threads:    22.1 / 38.3 at 128, 68.0 / 85.1 at 512, 119.9 / 162.7 at 1024 (one product splits
#                        the whole layer over the threads, a product per slot each small product);
#   repacked, 1 thread:  46.4 / 41.4 at 128, 107.1 / 69.3 at 256;
#   repacked, 2 threads: 23.6 / 35.9 at 128, 90.9 / 91.6 at 512 (the eighth stop's record: 99.6 / 98.6).
_GROUPED_FROM = {(False, 1): 256, (True, 1): 128}
_GROUPED_FROM_MANY_THREADS = {False: None, True: 512}


# A prompt's chunk of up to this many tokens goes through the batched kernel too, where it serves (its
# experts then picked by several rows each, which the kernel decodes once for). By hand, the bench model's
# layer 0, random picks, ms against ggml's products over plain slots at 8 / 32 / 64 / 128 / 256 tokens:
# 2 threads 1.65 / 5.47 / 9.32 / 17.55 / 36.31 against 3.20 / 10.82 / 13.55 / 17.37 / 27.18; 1 thread
# 2.45 / 7.79 / 16.62 / 32.06 / 64.82 against 3.36 / 15.82 / 25.29 / 38.21 / 47.24 (ggml's GEMM kernels
# take the longer ones). Since the kernel's bodies keep 5 to 8 rows' sums in registers (fortieth stop) it
# takes 128 tokens too (a layer of random picks at 2 threads, by hand: 64 tokens 6.4 ms, 128 12.0; a
# bench-model prompt of 128 tokens 198.7 → 175.4 ms, medians of three alternating runs) but not 256 (two
# calls of 128: 378 against ggml's 371 ms a prompt). The daemon's prompt chunks are 64 tokens
# (--prefill-chunk).
KERNEL_PROMPT_ROWS = 128


def grouped_from(threads: int, repacked: bool = False) -> int | None:
    """Prefill tokens from which a layer's experts are a product per expert, on `threads` threads over
    plain or repacked slots; None: never (one mul_mat_id is faster at every length measured)."""
    return _GROUPED_FROM.get((repacked, threads), _GROUPED_FROM_MANY_THREADS[repacked])


class GgmlExperts:
    """The cpu backend's expert device: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]), each token's
    experts added in the order its routing gives them (j = 0, 1, …: by descending probability, as
    llama.cpp adds them), whichever of them were resident.

    tier_bytes: the tier's budget (the cache's device tier); n_staging: staging slots per layout (a
    decode step's misses all fit in n_expert_used); repack: every slot in ggml's repacked form where it
    has kernels for the type (--repack-experts), else plain; kernel: a decode step's picks of a layer
    with plain slots of the types it has computed by fomoepy.runtime.batched_experts (each expert
    decoded once for all its rows), and a prompt chunk's of up to KERNEL_PROMPT_ROWS tokens, where the CPU
    runs it; else ggml's."""

    can_download = False  # this backend's one tier has no tier below it to demote into
    # a step's rows may be computed in runs (MoEStep): each call installs its own misses the plan admitted
    # and stages the rest from the step's reads, so a run's products are those it gets alone
    computes_runs = True

    def __init__(self, layers: tuple[LayerExperts, ...], ops, routers=None, n_expert: int = 0, tier_bytes: int = 0,
                 n_staging: int = 8, repack: bool = False, kernel: bool = False):  # fmt: skip
        self.layers = layers
        self.ops = ops
        self.routers = routers  # every layer's router, to predict the next layer's experts
        by_layout: dict = {}
        for layer in layers:
            by_layout.setdefault(layout_of(layer), []).append(layer)
        self.pools: dict = {}
        for layout, members in by_layout.items():
            # every pool may take the whole budget: the cache keeps the sum of what they hold within it,
            # and a slot's memory is touched only once an expert is set into it
            n_tier = min(len(members) * n_expert, tier_bytes // store_expert_nbytes(members[0]))
            self.pools[layout] = SlotPool(layout, n_tier, n_staging, n_expert, repack)
        self.pool_of = [self.pools[layout_of(layer)] for layer in layers]
        self._spins = ggml_threads.spins()  # (OpenMP read its policy when ggml was loaded: it stays)
        # the step's reads land in the device's buffers (the streamer's `buffers`): a decode round computes
        # from them where they lie
        self.reads = DeviceReads()
        self.host_buffer = self.reads.take
        self.host_buffer_anywhere = True  # (DeviceReads.take: any thread; a read made ahead takes it as issued)
        self._part_sizes = [tuple(p.nbytes for p in layer.parts) for layer in layers]  # a record's parts, in order
        kernel = kernel and batched_experts.vector_kernel()
        self._graph_kernels: dict[int, batched_experts.GraphExperts] = {}
        self._kernel = [kernel and not any(pool.layer.repacked) and batched_experts.handles(pool.layer.qtypes, pool.layer.n_embd, pool.layer.n_ff)
                        for pool in self.pool_of]  # fmt: skip

    @property
    def kernel_layers(self) -> list[bool]:
        """Whether the batched kernel computes each layer's decode steps."""
        return list(self._kernel)

    def expert_nbytes(self, layer: int) -> int:
        return store_expert_nbytes(self.layers[layer])

    def install(self, key, parts) -> None:
        self.pool_of[key[0]].install(key, parts)

    def evict(self, key) -> None:
        self.pool_of[key[0]].evict(key)

    def download(self, key):
        return None

    def route(self, layer: int, h: np.ndarray, k: int) -> np.ndarray:
        """The experts `layer`'s router picks for h (the next layer's prediction on a decode step). A few rows'
        router product runs on one thread: it is small (~70 KB of weights on the bench model), and a second
        thread, asleep between graphs (fomoepy.runtime.ggml_threads), is woken for it at a cost larger
        than the product. Each output element is one thread's dot product either way: the same bits."""
        router = self.routers[layer]
        if isinstance(router, QuantMatrix) and h.shape[0] <= _ONE_THREAD_ROWS:
            return top_ids_of_product(h, router, k, 1)  # (a decode row's top k in the product's graph)
        return top_ids(self.ops.linear(h, router), k)

    def graph_inputs(self, layer: int) -> tuple | None:
        """What a decode token's graph needs to compute `layer`'s routed experts itself (the cpu backend's
        decode_token): its slot tensors and each expert's slot ([1, E, 1] int32), when every expert of
        the layer is in the tier and the backend's threads spin (or there is one); else None. With
        several threads that sleep while they wait, a decode row's attention graphs run on one thread and
        its experts on all (see GgmlBackend._graphs): one graph cannot do both. On a layer the batched
        kernel serves, the slot tensors are its GraphExperts (fomoepy.runtime.batched_experts)."""
        if not self._spins and self.ops.threads > 1:
            return None
        pool = self.pool_of[layer]
        slots = pool.slots_of(layer)
        if slots.min() < 0:
            return None
        if self._kernel[layer]:  # the batched kernel's nodes, which give a pick compute's bits
            return self._graph_experts(pool), slots.reshape(1, -1, 1)
        return [m.tensor for m in pool.layer.mats], slots.reshape(1, -1, 1)

    def _graph_experts(self, pool: SlotPool) -> batched_experts.GraphExperts:
        """The kernel's graph nodes over a pool's slots (one object a pool: the graphs keep what it holds)."""
        made = self._graph_kernels.get(id(pool))
        if made is None:
            layer = pool.layer
            made = self._graph_kernels[id(pool)] = batched_experts.GraphExperts(layer.address_table, layer.qtypes, layer.n_embd, layer.n_ff)
        return made

    def compute(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> np.ndarray:
        """One product over the layer's slots when every expert of the step is in the tier (or gets a
        tier slot as its read lands). Otherwise in rounds (SlotLayer.pick_outputs; a prefill's,
        grouped_outputs): the tier's experts
        while the step's reads are in flight, then the rest, misses the tier does not keep where their
        reads landed (the read arena's, not grouped) or in staging slots, as many rounds as they need;
        then the same weighted sum, in the same order, in numpy."""
        weights = np.ascontiguousarray(weights, dtype=F32)
        if self._kernel[layer] and (experts.phase is Phase.DECODE or ids.shape[0] <= KERNEL_PROMPT_ROWS):
            return self._kernel_step(layer, h, ids, weights, experts)
        pool, threads = self.pool_of[layer], self.ops.threads
        # a long prefill's experts each take their tokens as the rows of one product (GEMM kernels); a
        # decode step's rows each go alone (mul_mat_id), so a row's bits are its own in a batch of
        # sequences, and so do a short prefill's, where that is faster (grouped_from)
        # (asked of a prefill only: a decode step's frames are counted)
        grouped = (experts.phase is Phase.PREFILL
                   and (group_from := grouped_from(threads, any(pool.layer.repacked))) is not None  # the slots' form (--repack-experts)
                   and ids.shape[0] >= group_from)  # fmt: skip
        slots = pool.slots_of(layer)[ids]  # [T, k]
        # a decode step of more sequences than ggml keeps each row's bits for, where every row picks one
        # expert (its tiled K-quant GEMM takes an expert's rows from eight on): its rows in parts of fewer
        parts = _row_parts(pool, ids.shape[0]) if ids.shape[0] > 1 and experts.phase is Phase.DECODE else None
        # a decode row's few ints as lists, its test without numpy: a reduction here, the step's first after
        # the layer's products, took ~10 µs (line_profiler, bench model at a 25 % tier)
        listed = (ids.ravel().tolist(), slots.ravel().tolist()) if ids.shape[0] == 1 else None
        if (min(listed[1]) if listed is not None else slots.min()) >= 0:  # every expert in the tier: one product (a decode step's usual case)
            experts.landed()
            if grouped:
                return pool.layer.ffn_grouped(h, slots, weights, threads)
            h = np.ascontiguousarray(h, dtype=F32)
            tuned = self.ops.row_threads if h.shape[0] == 1 else None
            if tuned is not None:  # a decode row: on the count measured faster for this layer's experts
                return tuned.run(("experts", pool.layer), lambda n: pool.layer.ffn_unchecked(h, slots, weights, n))
            if parts is not None:
                return np.concatenate([pool.layer.ffn_unchecked(h[p], slots[p], weights[p], threads) for p in parts])
            return pool.layer.ffn_unchecked(h, slots, weights, threads)
        slot_of: dict[int, int] = {}
        missing = []
        id_list, slot_list = listed if listed is not None else (ids.ravel().tolist(), slots.ravel().tolist())
        held = dict(zip(id_list, slot_list))  # expert -> its tier slot, -1: none
        for e in sorted(held):  # ascending expert id, as np.unique gave them (a few ints: no numpy call)
            if held[e] >= 0:
                slot_of[e] = held[e]
            else:
                missing.append(e)
        y = np.empty((*ids.shape, pool.layer.n_embd), F32)  # [T, k, K]: each pick's expert output
        early = list(slot_of) if any(map(_is_read, experts.pending.values())) else []  # (no generator's frame)
        try:
            if early:  # the tier's experts while the reads go on
                for p in parts or (slice(None),):
                    _round(pool, h[p], ids[p], early, slot_of, y[p], threads, grouped)
        finally:  # even when that failed: the cache marks the admitted experts ready once their reads land
            staged = self._install_admitted(layer, missing, slot_of, experts)
        in_place = self._read_in_place(layer, staged, experts.fetched) if not grouped else {}
        if in_place:
            staged = [e for e in staged if e not in in_place]
        if not early and not staged and not in_place:
            if grouped:
                return pool.layer.ffn_grouped(h, _slots(ids, slot_of), weights, threads)
            held = _slots(ids, slot_of)
            return np.concatenate([pool.layer.ffn(h[p], held[p], weights[p], threads) for p in parts or (slice(None),)])
        rest = [e for e in slot_of if e not in early]
        n = pool.n_staging
        for start in range(0, max(len(staged), 1), n):
            chunk = staged[start : start + n]
            for i, e in enumerate(chunk):
                slot_of[e] = pool.stage(i, experts.fetched[e])
            for p in parts or (slice(None),):
                if in_place:  # (the first round: those read into the arena with the tier's)
                    _round_in_place(pool, self.reads, h[p], ids[p], rest + chunk, slot_of, in_place, y[p], threads)
                else:
                    _round(pool, h[p], ids[p], rest + chunk, slot_of, y[p], threads, grouped)
            in_place = {}
            rest = []
        return weighted_sum(y, weights)  # expert j added after 0..j-1, as SlotLayer.ffn's graph adds them

    def _kernel_step(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> np.ndarray:
        """A decode step's picks by the batched kernel, each from where its expert's bytes lie: a tier slot,
        or the step's read of it (no staging copy). The tier's experts first while reads are in flight;
        then the weighted sum, in the picks' order (as compute's)."""
        pool, threads = self.pool_of[layer], self.ops.threads
        T, k = ids.shape
        if T * k > batched_experts.MAX_PICKS:  # (more picks than a call takes: the rows in parts, each row's bits its own)
            n = batched_experts.MAX_PICKS // k
            return np.concatenate([self._kernel_step(layer, h[a : a + n], ids[a : a + n], weights[a : a + n], experts) for a in range(0, T, n)])
        table, qtypes, n_ff = pool.layer.address_table, pool.layer.qtypes, pool.layer.n_ff
        slots = pool.slots_of(layer)[ids].ravel()
        if slots.min() >= 0:  # every expert in the tier (a decode step's usual case): the slots index the table
            experts.landed()
            tuned = self.ops.row_threads if T == 1 else None
            if tuned is not None:  # a decode row: on the count measured faster for this layer's experts (the same bits)
                y = tuned.run(("experts", pool.layer), lambda n: batched_experts.pick_outputs(h, _pick_rows(T, k), slots, table, qtypes, n_ff, n))
            else:
                y = batched_experts.pick_outputs(h, _pick_rows(T, k), slots, table, qtypes, n_ff, threads)
            return weighted_sum(y.reshape(T, k, -1), weights)
        id_list, slot_list = ids.ravel().tolist(), slots.tolist()
        held = dict(zip(id_list, slot_list))  # expert -> its tier slot, -1: none
        y = np.empty((T * k, pool.layer.n_embd), F32)
        in_tier = [p for p, s in enumerate(slot_list) if s >= 0]
        early = bool(in_tier) and any(map(_is_read, experts.pending.values()))
        slot_of = {e: s for e, s in held.items() if s >= 0}
        try:
            if early:  # the tier's picks while the reads go on
                y[in_tier] = batched_experts.pick_outputs(h, _pick_rows(T, k)[in_tier], slots[in_tier], table, qtypes, n_ff, threads)
        finally:  # even when that failed: the cache marks the admitted experts ready once their reads land
            self._install_admitted(layer, [e for e, s in held.items() if s < 0], slot_of, experts)  # (the rest: from their reads)
        if not early:
            in_tier = []
        # the rest: from the slots of those in the tier or installed now, and where the reads of those not kept
        # lie; the call's address table holds just their experts (not a copy of the tier's every step)
        done = set(in_tier)
        rest = [p for p in range(T * k) if p not in done]
        needed = list(dict.fromkeys(id_list[p] for p in rest))
        where = np.array([table[slot_of[e]] if e in slot_of else [contiguous_address(part) for part in experts.fetched[e]] for e in needed],
                         np.uint64)  # fmt: skip
        row_of = {e: i for i, e in enumerate(needed)}
        index = np.array([row_of[id_list[p]] for p in rest], np.int32)
        y[rest] = batched_experts.pick_outputs(h, _pick_rows(T, k)[rest], index, where, qtypes, n_ff, threads)
        return weighted_sum(y.reshape(T, k, -1), weights)

    def _read_in_place(self, layer: int, staged: list[int], fetched: dict) -> dict[int, tuple]:
        """Of the misses the tier does not keep, those whose reads landed in the read arena, with (the arena,
        their buffer): where the slots are plain, computed there, in place."""
        if not staged or any(self.pool_of[layer].layer.repacked):
            return {}
        return self.reads.in_arena(staged, fetched, self._part_sizes[layer])  # (one arena: that of the layer's record size)

    def _install_admitted(self, layer: int, missing: list[int], slot_of: dict[int, int], experts: StepExperts) -> list[int]:
        """Wait for the step's reads and set the experts the cache gave tier slots into theirs; returns
        the others (to be staged)."""
        fetched = experts.landed()
        admitted = {item.expert for item in experts.plan.items if item.to_device} if experts.plan is not None else set()
        pool, staged = self.pool_of[layer], []
        for e in missing:
            if e in admitted:  # the cache gave it a tier slot: its bytes go there
                slot_of[e] = pool.install((layer, e), fetched[e])
            else:
                staged.append(e)
        return staged

    def close(self) -> None:
        self.reads.close()  # (its graphs read the pools' slot tensors: freed first)
        for pool in self.pools.values():
            pool.close()


_is_read = functools.partial(operator.is_not, None)  # a pending entry that is a read in flight (None: read without a pool)


@functools.lru_cache(maxsize=64)
def _pick_rows(T: int, k: int) -> np.ndarray:
    """Each pick's row, picks token-major: [T·k] int32 (read-only: kept for the next step)."""
    rows = np.repeat(np.arange(T, dtype=np.int32), k)
    rows.flags.writeable = False
    return rows


def _slots(ids: np.ndarray, slot_of: dict[int, int]) -> np.ndarray:
    """[T, k] expert ids → their slots (-1 for an expert not placed yet)."""
    lut = np.full(int(ids.max()) + 1, -1, np.int32)
    lut[list(slot_of)] = list(slot_of.values())
    return lut[ids]


def _row_parts(pool: SlotPool, rows: int) -> list[slice] | None:
    """A decode step's rows in parts that each keep every row's own bits in ggml's products of the pool's
    slots (ggml_slots.rows_kept_together); None: all of them at once."""
    together = pool.layer.rows_kept_together
    if together is None or rows <= together:
        return None
    return [slice(first, min(first + together, rows)) for first in range(0, rows, together)]


def _round(pool: SlotPool, h: np.ndarray, ids: np.ndarray, chosen: list[int], slot_of: dict[int, int], y: np.ndarray,
           threads: int, grouped: bool) -> None:  # fmt: skip
    """y[t, j] for every pick of the `chosen` experts (all of each one's picks, token-major), by the
    products the one-product path uses: grouped rows (a prefill) or one row per pick (mul_mat_id)."""
    if not chosen:
        return
    if ids.shape[0] == 1 and not grouped:  # a decode row: its picks from the few ints, no array per step
        row, wanted = ids[0].tolist(), set(chosen)
        js = [j for j, e in enumerate(row) if e in wanted]  # its picks of the chosen experts, in order
        pool.layer.pick_outputs_of_row_into(h, [slot_of[row[j]] for j in js], threads, y[0], js)
        return
    # one lookup, expert -> its slot where chosen (-1 elsewhere), gives both the picks and their slots: a
    # round's few numpy calls are most of its host time (np.isin and a second lookup were ~15 µs more;
    # sized by the layer's experts, not ids.max(), one reduction fewer)
    lut = np.full(pool.n_expert, -1, np.int32)
    lut[chosen] = [slot_of[e] for e in chosen]
    picked = lut[ids]  # [T, k]
    mask = picked >= 0
    rows = np.nonzero(mask)[0]  # token of each pick, in (token, pick) order
    if grouped:
        y[mask] = pool.layer.grouped_outputs(h, rows, picked[mask], threads)
    else:
        y[mask] = pool.layer.pick_outputs(h[rows], picked[mask], threads)


def _round_in_place(pool: SlotPool, reads: DeviceReads, h: np.ndarray, ids: np.ndarray, chosen: list[int], slot_of: dict[int, int],
                    in_place: dict[int, tuple], y: np.ndarray, threads: int) -> None:  # fmt: skip
    """_round (not grouped) whose picks are the `chosen` experts' (in slots) and those read into the read arena
    (`in_place`: expert -> (arena, buffer)), each computed where it lies, in one graph."""
    arena = next(iter(in_place.values()))[0]
    if ids.shape[0] == 1:  # a decode row: its picks from the few ints, its row set once
        row, wanted = ids[0].tolist(), set(chosen)
        js = [j for j, e in enumerate(row) if e in wanted]
        js_read = [j for j, e in enumerate(row) if e in in_place]
        reads.outputs_of_row_into(pool.layer, h, [slot_of[row[j]] for j in js], arena, [in_place[row[j]][1] for j in js_read],
                                  threads, y[0], js, js_read)  # fmt: skip
        return
    # several rows (a batch of sequences' decode rows, a short prompt): each pick a row, as _round's
    lut, lut_read = np.full(pool.n_expert, -1, np.int32), np.full(pool.n_expert, -1, np.int32)
    lut[chosen] = [slot_of[e] for e in chosen]
    lut_read[list(in_place)] = [buf for _, buf in in_place.values()]
    picked, read = lut[ids], lut_read[ids]
    mask, mask_read = picked >= 0, read >= 0
    y[mask], y[mask_read] = reads.pick_outputs(pool.layer, h[np.nonzero(mask)[0]], picked[mask], arena,
                                               h[np.nonzero(mask_read)[0]], read[mask_read], threads)  # fmt: skip


def per_expert_ffn(parts, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, fetched: dict, threads: int) -> np.ndarray:
    """The same sum computed expert by expert from store bytes in place (fomoepy.runtime.ggml_matmul,
    plain kernels): the independent path the slots are checked against (tests, bench/moe_layer.py)."""
    flat_ids, k = ids.reshape(-1), ids.shape[1]
    order = np.argsort(flat_ids, kind="stable")
    bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
    picks = {int(flat_ids[group[0]]): group for group in np.split(order, bounds)}  # each expert's picks (t·k + j)
    groups = [(picks[e] // k, *expert_matrices(fetched[e], parts)) for e in picks]
    y = np.empty((ids.size, h.shape[1]), F32)  # each pick's expert output
    for group, ye in zip(picks.values(), expert_ffn(h, groups, threads)):
        y[group] = ye
    return weighted_sum(y.reshape(*ids.shape, -1), np.asarray(weights, F32))  # picks added in their order


def expert_matrices(raw, parts) -> tuple[QuantMatrix, ...]:
    """An expert's gate, up and down as ggml reads them: views of its store-form bytes `raw`."""
    return tuple(QuantMatrix.of(raw[i], q.qtype, q.shape) for i, q in enumerate(parts))


def store_expert_nbytes(layout: LayerExperts) -> int:
    """The unit of this backend's tier: one expert's store bytes (a slot holds as many, repacked or not)."""
    return layout.expert_nbytes
