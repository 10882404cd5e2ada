"""The simulated device's shared-memory checks: the race detector (compute-sanitizer's racecheck), static
shared arrays filled with NaN at each block's start, and warps run in seeded orders, under which a
kernel's result must not change.

A race is a write to a shared byte that another thread read or wrote in the same barrier interval, or
a read of a byte another thread wrote in it; only __syncthreads() ends an interval. The kernels here
are written for the test, each with one defect or none; the ops themselves (hip_kernels/) run under
the detector in every simulated test (it is on unless FOMOEPY_SIM_RACECHECK=0), and here under three
more warp orders.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from sim_backend import sim_backend
from test_sim_device import Device, build

from fomoepy.runtime.shim import GpuError
from fomoepy.runtime.sim.shim import configure

F32 = np.float32

RACE_KERNELS = r"""
#include "compat.h"

// thread t takes its neighbour's value through shared memory and writes back twice it.
// mode 0: a barrier between every write and every read of another thread's word: no race
// mode 1: the barrier between the reads and the overwrites dropped (a write after another's read)
// mode 2: the barrier between the first writes and the reads dropped (a read of another's write)
// mode 3: every thread writes word 0 (a write after another's write)
KERNEL void LAUNCH_BOUNDS(64) neighbour(float* out, int mode) {
    SHARED(float, pad, [3]);  // the array under test does not start at shared address 0
    SHARED(float, s, [64]);
    const int t = threadIdx.x;
    if (t < 3) pad[t] = 0.0f;
    s[t] = (float)t;
    if (mode != 2) __syncthreads();
    const float v = s[(t + 1) % 64];
    if (mode != 1) __syncthreads();
    if (mode == 3) s[0] = v;
    else s[t] = 2.0f * v;
    __syncthreads();
    out[blockIdx.x * 64 + t] = s[t] + s[0];  // every thread reads word 0: readers alone never race
}

// lane 0 writes, the warp shuffles, lane 1 reads: a shuffle is no barrier for shared memory
KERNEL void LAUNCH_BOUNDS(32) shuffle_is_no_barrier(float* out) {
    SHARED(float, s, [32]);
    const int lane = threadIdx.x;
    if (lane == 0) s[0] = 1.0f;
    const float w = SHFL_XOR((float)lane, 1);
    out[lane] = w + (lane == 1 ? s[0] : 0.0f);
}

// the launch's dynamic shared memory, written and read back reversed without a barrier
KERNEL void LAUNCH_BOUNDS(64) dynamic_reversed(float* out) {
    DYN_SHARED(float, d);
    d[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = d[63 - threadIdx.x];
}

// reads a static shared array before anything writes it, then fills it with 1.0
KERNEL void LAUNCH_BOUNDS(64) read_static_shared(float* out) {
    SHARED(float, s, [64]);
    if (threadIdx.x == 0) out[blockIdx.x] = s[63];
    __syncthreads();
    s[threadIdx.x] = 1.0f;
}

// lane 0 of every warp writes its warp's index to out[block]: the warp that runs last wins
KERNEL void LAUNCH_BOUNDS(256) last_warp_wins(int* out) {
    if (threadIdx.x % WARP == 0) out[blockIdx.x] = threadIdx.x / WARP;
}
"""
SIGNATURES = {"neighbour": "pi", "shuffle_is_no_barrier": "p", "dynamic_reversed": "p", "read_static_shared": "p", "last_warp_wins": "p"}


@pytest.fixture(scope="module")
def binary() -> bytes:
    return build(text=RACE_KERNELS)


@pytest.fixture
def dev(binary):
    d = Device(binary, signatures=SIGNATURES)
    yield d
    d.close()


@pytest.fixture
def order():
    """order(seed): the warp order of the launches that follow; index order again after the test."""
    before = configure()
    yield lambda seed: configure(order_seed=seed)
    configure(**before)


def run_neighbour(binary, mode: int, blocks: int = 2) -> np.ndarray:
    d = Device(binary, signatures=SIGNATURES)
    out = d.empty(64 * blocks)
    d.launch("neighbour", (blocks,), (64,), out, mode)
    try:
        return d.download(out, 64 * blocks)
    finally:
        d.buffers.clear()  # a failed stream stays failed: leave its memory to the process


def test_a_kernel_with_a_barrier_between_every_write_and_read_passes(binary):
    t = np.arange(64)
    got = run_neighbour(binary, 0).reshape(2, 64)
    s = 2.0 * ((t + 1) % 64)
    assert np.array_equal(got, np.tile(s + s[0], (2, 1)))


@pytest.mark.parametrize(
    "mode,message",
    [
        (1, r"thread (\d+) writes it and thread (\d+) read it"),
        # which of the two comes first depends on the order: t reads s[t + 1] before t + 1 writes it
        (2, r"thread (\d+) (?:writes it and thread (\d+) read|reads it and thread (\d+) wrote) it"),
        (3, r"thread (\d+) writes it and thread (\d+) wrote it"),
    ],
    ids=["write after read", "read after write", "write after write"],
)
def test_a_missing_barrier_is_a_race_naming_kernel_block_address_and_both_threads(binary, mode, message):
    with pytest.raises(GpuError) as e:
        run_neighbour(binary, mode)
    text = str(e.value)
    assert "kernel neighbour, block (0,0,0)" in text, text
    # `s` follows the 12 bytes of `pad`, at shared address 12: an address inside it, and which word
    found = re.search(r"shared-memory race at shared address 0x([0-9a-f]+) \(s \+ (\d+)\): " + message, text)
    assert found, text
    address, offset = int(found[1], 16), int(found[2])
    me, other = int(found[3]), int(next(g for g in found.groups()[3:] if g is not None))
    assert address == 12 + offset and me != other
    word = offset // 4
    if mode in (1, 2):  # s[w] is written by thread w and read by thread w - 1
        assert {me, other} == {word, (word - 1) % 64}
    else:
        assert word == 0


def test_a_shuffle_does_not_order_shared_memory(binary):
    d = Device(binary, signatures=SIGNATURES)
    d.launch("shuffle_is_no_barrier", (1,), (32,), d.empty(32))
    with pytest.raises(GpuError, match=r"kernel shuffle_is_no_barrier.*race at shared address 0x0 \(s \+ 0\): thread 1 reads it and thread 0 wrote it"):
        d.rt.sync(d.stream)


def test_races_in_dynamic_shared_memory_are_found_too(binary):
    d = Device(binary, signatures=SIGNATURES)
    d.launch("dynamic_reversed", (1,), (64,), d.empty(64), shared=64 * 4)
    # in index order threads 0..31 read what 63..32 have not yet written; thread 32 then overwrites d[32]
    with pytest.raises(GpuError, match=r"race at shared address 0x80 \(dynamic shared memory \+ 128\): thread 32 writes it and thread 31 read it"):
        d.rt.sync(d.stream)


def test_without_the_detector_the_same_races_pass_unseen():
    """The control: built with FOMOEPY_SIM_RACECHECK=0, every defective mode runs to an answer (mode 2's
    reads of words not yet written give NaN, the poison, in index order)."""
    plain = build(text=RACE_KERNELS, racecheck=False)
    for mode in (1, 2, 3):
        assert run_neighbour(plain, mode).shape == (128,)


def test_static_shared_arrays_are_nan_at_each_blocks_start(dev):
    """Each block reads before it writes; 32 blocks over the host threads, so blocks follow one
    another on one thread and a value left by the block before would show."""
    out = dev.empty(32)
    dev.launch("read_static_shared", (32,), (64,), out)
    assert np.isnan(dev.download(out, 32)).all()


def test_a_seeded_order_runs_the_warps_in_another_order(dev, order):
    """An order-dependent kernel: index order lets warp 7 write last in every block; a seed draws
    another order per block, the same one every time it runs."""
    out = dev.empty(64)

    def run(seed: int) -> np.ndarray:
        order(seed)
        dev.launch("last_warp_wins", (64,), (256,), out)
        return dev.download(out, 64, np.int32)

    assert (run(0) == 7).all()
    seeded = [run(seed) for seed in (1, 2, 1)]
    assert np.array_equal(seeded[0], seeded[2])
    assert not np.array_equal(seeded[0], seeded[1])
    assert len(np.unique(seeded[0])) >= 6  # last among 8 warps: every warp gets its turn somewhere


# -- the ops: their results do not depend on the order of their warps ---------------------------------


def barrier_ops(dev) -> list[np.ndarray]:
    """Every op whose kernel shares memory across warps (block reductions, the attention merge)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5, 4096)) * 0.5).astype(F32)  # small logits: a warp's sum of exps tops the max
    q, kv = rng.standard_normal((9, 4, 128)).astype(F32), rng.standard_normal((64, 2, 128)).astype(F32)
    route = dev.route(x[:, :512], "softmax", 10)
    outs = [dev.softmax(x), dev.rms_norm(x, x[0], 1e-6), dev.l2_norm(x, 1e-6), route.probs, route.ids, route.weights,
            dev.argmax(x), dev.attention(q, dev.upload(kv), dev.upload(kv), 30), dev.attention(q[:1], dev.upload(kv), dev.upload(kv), 50)]  # fmt: skip
    return [np.asarray(o) for o in outs]


def assert_order_independent(dev, order) -> None:
    base = barrier_ops(dev)
    for seed in (1, 2, 3):
        order(seed)
        for i, (a, b) in enumerate(zip(base, barrier_ops(dev))):
            assert np.array_equal(a, b, equal_nan=True), f"op {i} differs under warp order {seed}"


def test_the_ops_give_the_same_bits_in_every_warp_order(order):
    assert_order_independent(sim_backend(), order)
