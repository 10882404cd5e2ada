"""One layer's routed experts as one mul_mat_id product over the host tier's slots (SlotLayer): bit for
bit the per-expert path (GgmlExperts) with plain buffers; repacked slot products equal plain ones up
to the order of their float32 sums."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from float32_bounds import U
from gguf import GGMLQuantizationType as QT

from fomoepy import quants
from fomoepy.errors import FomoeError
from fomoepy.runtime import ggml_buffers, ggml_slots
from fomoepy.runtime.ggml_experts import per_expert_ffn
from fomoepy.runtime.ggml_slots import SlotLayer, SlotMatrix

F32 = np.float32
K, F, N_EXPERT, N_SLOT, TOP_K = 512, 256, 10, 12, 4
PARTS = [(int(QT.Q4_K), (F, K)), (int(QT.Q4_K), (F, K)), (int(QT.Q6_K), (K, F))]  # the bench model's types


@pytest.fixture(scope="module")
def experts():
    """{expert: ([gate, up, down] store bytes, [the same dequantised, float64])}."""
    rng = np.random.default_rng(11)
    out = {}
    for e in range(N_EXPERT):
        raw = [quants.quantize(rng.standard_normal(s).astype(F32) * 0.1, q).reshape(-1) for q, s in PARTS]
        out[e] = (raw, [quants.dequantize(r, q, s).astype(np.float64) for r, (q, s) in zip(raw, PARTS)])
    return out


def filled(experts, repack: bool, rng) -> tuple[SlotLayer, np.ndarray]:
    """A layer whose slots hold the experts at shuffled places; slot_of[e] says where."""
    layer = SlotLayer(PARTS, N_SLOT, repack=repack)
    slot_of = rng.permutation(N_SLOT)[:N_EXPERT]
    for e, (raw, _) in experts.items():
        layer.set_slot(int(slot_of[e]), raw)
    return layer, slot_of


def routing(rng, T):
    ids = np.stack([np.sort(rng.choice(N_EXPERT, TOP_K, replace=False)) for _ in range(T)])  # ascending id
    return ids, rng.dirichlet(np.ones(TOP_K), size=T).astype(F32)


@pytest.mark.parametrize("T", [1, 7, 40])  # 40: a graph built for its call alone
@pytest.mark.parametrize("threads", [1, 2])
def test_plain_slots_equal_the_per_expert_path_bit_for_bit(experts, T, threads):
    rng = np.random.default_rng(T + 10 * threads)
    layer, slot_of = filled(experts, False, rng)
    assert layer.repacked == (False, False, False)
    parts = [SimpleNamespace(qtype=q, shape=s) for q, s in PARTS]
    fetched = {e: raw for e, (raw, _) in experts.items()}
    results = []  # each call's results stay the caller's after the graph's next run
    for _ in range(2):  # the second call reuses the graph with new inputs
        h = rng.standard_normal((T, K)).astype(F32)
        ids, w = routing(rng, T)
        got = layer.ffn(h, slot_of[ids], w, threads)
        want = per_expert_ffn(parts, h, ids, w, fetched, threads)
        assert np.array_equal(got, want)
        assert np.array_equal(layer.ffn_grouped(h, slot_of[ids], w, threads), want)
        # each (token, pick) a row of its own: the same expert outputs, unweighted
        y = layer.pick_outputs(np.repeat(h, TOP_K, axis=0), slot_of[ids].reshape(-1), threads).reshape(T, TOP_K, K)
        summed = y[:, 0] * w[:, :1]
        for j in range(1, TOP_K):
            summed = summed + y[:, j] * w[:, j : j + 1]
        assert np.array_equal(summed, want)
        for t in range(T):  # a decode row's round: its picks' outputs from the row and the slots' list,
            # the bits of pick_outputs on the row repeated (a slot's count of rows picks ggml's kernel, so a
            # row's picks among 40 tokens' may differ: the round's are a row's alone, as before)
            slots = slot_of[ids[t]]
            alone = layer.pick_outputs(np.repeat(h[t : t + 1], TOP_K, axis=0), slots, threads)
            assert np.array_equal(layer.pick_outputs_of_row(h[t : t + 1], slots.tolist(), threads), alone)
        results.append((got, y, got.copy(), y.copy()))
    assert all(np.array_equal(a, a0) and np.array_equal(b, b0) for a, b, a0, b0 in results)
    assert not np.array_equal(results[0][0], results[1][0])
    layer.close()


def exactly_quantized_rows(rng, T, n):
    """Rows that ggml's Q8_K rounding keeps exactly: integers in [-127, 127], each 256-block's largest
    magnitude 127 (the block's scale is then 1)."""
    x = rng.integers(-127, 128, size=(T, n)).astype(F32)
    x[:, ::256] = 127 * np.sign(rng.standard_normal((T, n // 256)) + 0.5).astype(F32)
    return x


@pytest.mark.parametrize("part", [0, 2])
@pytest.mark.parametrize("T", [1, 6])
def test_repacked_slot_products_equal_plain_ones_up_to_the_order_of_float32_sums(experts, part, T):
    # repacked kernels compute the same integer block dot products of the same Q8_K activations (exact
    # here) and add their float32 partial sums in another order: each result lies within 2·n·u·Σ|terms|
    # of the exact sum (n ≤ the row length), so the two differ by at most twice that
    qtype, (rows, cols) = PARTS[part]
    rng = np.random.default_rng(20 + part + T)
    slot_of = rng.permutation(N_SLOT)[:N_EXPERT]
    mats = {}
    for repack in (False, True):
        m = mats[repack] = SlotMatrix(qtype, rows, cols, N_SLOT, repack)
        for e, (raw, _) in experts.items():
            m.set_slot(int(slot_of[e]), raw[part])
    if not mats[True].repacked:
        pytest.skip(f"no repacked kernels for type {qtype} [{rows}, {cols}] on this CPU")
    x = exactly_quantized_rows(rng, T, cols)
    ids, _ = routing(rng, T)
    plain, repacked = (mats[r].product(x, slot_of[ids], 2) for r in (False, True))
    for t in range(T):
        for j, e in enumerate(ids[t]):
            w = experts[int(e)][1][part]
            exact = w @ x[t].astype(np.float64)
            terms = np.abs(w) @ np.abs(x[t].astype(np.float64))
            assert np.all(np.abs(plain[t, j] - exact) <= 2 * cols * U * terms)
            assert np.all(np.abs(repacked[t, j] - plain[t, j]) <= 4 * cols * U * terms)
    for m in mats.values():
        m.close()


def test_repacked_slots_give_the_same_bits_on_one_thread_or_two(experts):
    rng = np.random.default_rng(3)
    layer, slot_of = filled(experts, True, rng)
    h = rng.standard_normal((4, K)).astype(F32)
    ids, w = routing(rng, 4)
    assert np.array_equal(layer.ffn(h, slot_of[ids], w, 1), layer.ffn(h, slot_of[ids], w, 2))
    assert np.array_equal(layer.ffn_grouped(h, slot_of[ids], w, 1), layer.ffn_grouped(h, slot_of[ids], w, 2))
    layer.close()


def test_the_cpu_repacks_q4_k_where_it_has_avx2():
    # the bench model's gate/up: repacked as llama.cpp's are on this CPU kind (Q4_K 8x8 kernels need AVX2)
    import ggml

    if not ggml.ggml_cpu_has_avx2():
        pytest.skip("no AVX2: ggml has no repacked Q4_K kernels here")
    assert ggml_buffers.repacks(int(QT.Q4_K), K, F)
    assert not ggml_buffers.repacks(int(QT.F32), K, F)  # float weights have no repacked kernels


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("k", [1, 2, 8, 10])
def test_the_weighted_sum_adds_each_tokens_picks_in_order_bit_for_bit(T, k):
    # numpy's sum of the picks (two calls) must be the graph's: each product rounded, then added pick by pick
    from fomoepy.runtime.ggml_slots import weighted_sum

    rng = np.random.default_rng(T * 100 + k)
    y = (rng.standard_normal((T, k, 1024)) * rng.uniform(0.01, 100, size=(T, k, 1))).astype(np.float32)
    w = rng.dirichlet(np.ones(k), size=T).astype(np.float32)
    want = y[:, 0] * w[:, :1]
    for j in range(1, k):
        want = want + y[:, j] * w[:, j : j + 1]
    got = weighted_sum(y, w)
    assert got.shape == (T, 1024) and got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("scratch", [True, False])  # False: arrays too large for the reused scratch
def test_grouped_picks_in_any_order_are_each_picks_own_product_and_stay_the_callers(experts, scratch, monkeypatch):
    # a streamed prefill's round (grouped_outputs) lists picks of any tokens, repeated, in any slot order;
    # on plain slots a pick's output is its row's own (each output element one dot product of that row),
    # so pick_outputs (one row per pick) gives the same bits. The results must stay the caller's when the
    # next call reuses the thread's scratch.
    from fomoepy.runtime import ggml_slots

    if not scratch:
        monkeypatch.setattr(ggml_slots, "_SCRATCH_BYTES", 0)
    rng = np.random.default_rng(31)
    layer, slot_of = filled(experts, False, rng)
    kept = []
    for _ in range(2):
        h = rng.standard_normal((9, K)).astype(F32)
        tokens = rng.integers(0, 9, size=23)
        slots = slot_of[rng.integers(0, N_EXPERT, size=23)]
        got = layer.grouped_outputs(h, tokens, slots, 1)
        assert np.array_equal(got, layer.pick_outputs(h[tokens], slots, 1))
        ids, w = routing(rng, 9)
        summed = layer.ffn_grouped(h, slot_of[ids], w, 1)
        assert np.array_equal(summed, layer.ffn(h, slot_of[ids], w, 1))
        kept.append((got, got.copy(), summed, summed.copy()))
    assert all(np.array_equal(a, a0) and np.array_equal(b, b0) for a, a0, b, b0 in kept)
    assert layer.grouped_outputs(h, tokens[:0], slots[:0], 1).shape == (0, K)
    layer.close()


def test_bad_slots_and_bytes_are_one_clear_error(experts):
    layer = SlotLayer(PARTS, 2, repack=False)
    raw = experts[0][0]
    with pytest.raises(FomoeError, match="slot 2 outside"):
        layer.set_slot(2, raw)
    with pytest.raises(FomoeError, match="bytes for a slot"):
        layer.set_slot(0, [raw[0][:-1], raw[1], raw[2]])
    with pytest.raises(FomoeError, match="slot ids must lie in"):
        layer.ffn(np.zeros((1, K), F32), np.array([[0, 2]]), np.ones((1, 2), F32), 1)
    for slots in ([0, 2], [-1, 0]):  # a decode row's round checks its slots as well
        with pytest.raises(FomoeError, match="slot ids must lie in"):
            layer.pick_outputs_of_row(np.zeros((1, K), F32), slots, 1)
    with pytest.raises(FomoeError, match="expected gate/up"):
        SlotLayer([PARTS[0], PARTS[1], PARTS[0]], 2)
    layer.close()


@pytest.mark.parametrize("name", ["qwen3moe_q4_k_m", "qwen35moe_q4_k"])
def test_an_engine_on_plain_slots_gives_the_per_expert_paths_logits_bit_for_bit(name):
    # the engine's device with every slot plain against the per-expert products from the mapped bytes,
    # prefill and decode steps (the cached one-token graphs)
    from conftest import ORACLE

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.runtime.ggml_experts import GgmlExperts

    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    runs = []
    for slots in (False, True):
        engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2, ram_cache=0))  # every expert read
        device = engine.experts.device
        if slots:
            plain = GgmlExperts(device.layers, engine.ops, device.routers, engine.spec.moe.n_expert, 0, engine.spec.moe.n_expert,
                                repack=False)  # fmt: skip
            device.compute = plain.compute  # every expert staged into a plain slot
        else:
            def per_expert(layer, h, ids, w, experts, device=device, engine=engine):
                fetched = {e: engine.source.read(layer, e) for e in np.unique(ids).tolist()}
                return per_expert_ffn(device.layers[layer].parts, h, ids, w, fetched, 2)

            device.compute = per_expert
        state = engine.new_state()
        prefill = engine.eval(state, tokens[:-3], all_logits=True)
        steps = [engine.eval(state, [t])[-1] for t in tokens[-3:]]  # decode steps: one token each
        runs.append((prefill, steps))
        engine.close()
    (p0, s0), (p1, s1) = runs
    assert np.array_equal(p0, p1)
    assert all(np.array_equal(a, b) for a, b in zip(s0, s1))


def test_filling_repacked_slots_writes_nothing_to_stderr():
    # ggml's default log prints a debug line for every tensor the repacking buffer repacks
    import subprocess
    import sys

    code = (
        "import numpy as np\nfrom fomoepy.runtime.ggml_slots import SlotMatrix\n"
        f"m = SlotMatrix({int(QT.Q4_K)}, {F}, {K}, 3)\n"
        "for s in range(3): m.set_slot(s, np.zeros(m.slot_nbytes, np.uint8))\nprint(m.repacked)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr == ""


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_round_in_one_c_call_sets_the_numpy_rounds_bits_at_its_picks_places(experts, threads):
    """A decode round (pick_outputs_of_row_into) through its compiled call (fomoepy/runtime/_ggml_rounds.c:
    the row's copy, the picks' slots, ggml's graph and each output set at its pick's place) writes the bits
    of the same graph's numpy round, at the same places, and nothing else."""
    if ggml_slots.RoundCall is None:
        pytest.skip("fomoepy.runtime._ggml_rounds is not built (no C compiler at install)")
    rng = np.random.default_rng(5 + threads)
    layer, slot_of = filled(experts, False, rng)
    for js in ([2, 0, 3], [1], [0, 1, 2, 3]):  # the picks' places among the token's, not in order
        h = rng.standard_normal((1, K)).astype(F32)
        ids = rng.choice(N_EXPERT, TOP_K, replace=False)
        slots = [int(slot_of[ids[j]]) for j in js]
        graph = layer._pick_graph(len(js), threads, one_row=True)
        assert graph._round is not None
        got, want = np.full((TOP_K, K), np.nan, F32), np.full((TOP_K, K), np.nan, F32)
        before = ggml_slots.MATMUL.seconds
        layer.pick_outputs_of_row_into(h, slots, threads, got, js)
        assert ggml_slots.MATMUL.seconds > before  # its ggml time counted as the products'
        compiled, graph._round = graph._round, None  # the same graph, its numpy round
        try:
            layer.pick_outputs_of_row_into(h, slots, threads, want, js)
        finally:
            graph._round = compiled
        assert not np.isnan(got[js]).any()
        assert np.array_equal(got, want, equal_nan=True)  # the other places untouched in both
        assert np.array_equal(got[js], layer.pick_outputs(np.repeat(h, len(js), axis=0), np.array(slots), threads))


def test_the_weighted_sum_in_c_has_numpys_bits_and_leaves_what_it_cannot_take_to_numpy():
    """weighted_sum's compiled loop (products rounded to float32, pick j added after 0..j-1) gives numpy's
    `np.add.reduce(y * w[:, :, None], axis=1)` bit for bit, at a decode row's shape and others; arrays it
    does not take (not float32, not contiguous, shapes that disagree) it declines, and numpy serves."""
    if ggml_slots._rounds is None:
        pytest.skip("fomoepy.runtime._ggml_rounds is not built (no C compiler at install)")
    rng = np.random.default_rng(3)
    for T, k, n in [(1, 8, 1024), (1, 10, 4096), (3, 5, 7), (1, 1, 4), (17, 10, 300)]:
        y = (rng.standard_normal((T, k, n)) * rng.choice([1e-3, 1.0, 1e3], (T, k, 1))).astype(F32)
        w = rng.dirichlet(np.ones(k), size=T).astype(F32)
        out = np.full((T, n), np.nan, F32)
        assert ggml_slots._rounds.weighted_sum(y, w, out) is True
        want = np.add.reduce(y * w[:, :, None], axis=1)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(ggml_slots.weighted_sum(y, w).view(np.uint32), want.view(np.uint32))
    y, w = rng.standard_normal((2, 4, 6)).astype(F32), rng.random((2, 4)).astype(F32)
    out = np.zeros((2, 6), F32)
    for args in [(y.astype(np.float64), w, out), (y[:, ::2], w[:, ::2], out), (y, w[:, :3], out), (y, w, np.zeros((2, 5), F32))]:
        assert ggml_slots._rounds.weighted_sum(*args) is False
    assert not out.any()  # nothing written by those declined
    assert np.array_equal(ggml_slots.weighted_sum(y.astype(np.float64), w), np.add.reduce(y.astype(np.float64) * w[:, :, None], axis=1))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_weighted_sum_node_has_the_bits_of_ggmls_product_and_sums_then_the_residual(threads):
    """A decode graph's experts' weighted sum and its residual (weighted_sum_added_node: one node of
    _ggml_rounds) against the ggml nodes it stands for (weighted_sum_nodes' MUL and ADDs, then the ADD of
    x), bit for bit: rows of 1000 (no whole vector), 1 to 10 picks, a row or several, on any thread count."""
    import ggml

    from fomoepy.runtime.ggml_dense import Graph

    if ggml_slots._rounds is None:
        pytest.skip("fomoepy.runtime._ggml_rounds is not built (no C compiler at install)")
    rng = np.random.default_rng(threads)
    K = 1000
    for T, k in [(1, 8), (3, 1), (9, 10), (2, 4)]:
        y = (rng.standard_normal((T, k, K)) * rng.choice([1e-3, 1.0, 1e3], (T, k, 1))).astype(F32)
        w = rng.dirichlet(np.ones(k), size=T).astype(F32)
        x = (rng.standard_normal((T, K)) * 10).astype(F32)
        got_graph = Graph(8, 4 * K * T * (2 * k + 4) + 4096, threads)
        node = ggml_slots.weighted_sum_added_node(got_graph.ctx, got_graph.input(K, k, T), got_graph.input(k, T), got_graph.input(K, T))
        assert ggml.ggml_op_name(node.contents.op) == b"CUSTOM"
        got_graph.finish([(node, (T, K))])
        want_graph = Graph(8 + 2 * k, 4 * K * T * (2 * k + 4) + 4096, threads)
        ys, ws, xs = want_graph.input(K, k, T), want_graph.input(1, k, T), want_graph.input(K, T)
        want_graph.finish([(ggml.ggml_add(want_graph.ctx, xs, ggml_slots.weighted_sum_nodes(want_graph.ctx, ys, ws)), (T, K))])
        got, want = got_graph.run(y, w, x, last=True)[0], want_graph.run(y, w, x, last=True)[0]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (T, k)


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no transparent huge pages here")
@pytest.mark.parametrize("repack", [False, True])
def test_slot_tensors_memory_is_advised_to_huge_pages(repack):
    # a slot tensor's products stream it: its buffer (ggml's, 4 KiB pages unless advised) is marked for
    # transparent huge pages ("hg") before a byte is set into it; plain and repacking buffers alike
    matrix = SlotMatrix(QT.Q4_K, 512, 1024, 32, repack=repack)  # 9 MiB: whole 2 MiB pages inside
    base = ggml_buffers._C.buffer_get_base(matrix._buffer)
    assert matrix.repacked == (repack and ggml_buffers.repacks(QT.Q4_K, 1024, 512))
    assert "hg" in _vm_flags(-(-base // (2 << 20)) * (2 << 20))
