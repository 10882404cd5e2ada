"""The simulated device's rules, each checked with a small kernel that a device without the rule
would get wrong: barriers, warp shuffles, dynamic shared memory poisoned with NaN, the errors that
name the kernel (deadlock, a barrier after an exit, a shuffle reading an exited lane, a block over
its launch bound, a pointer into another device), and streams that only order what events order.

The kernels here are written for the test and compiled with the same compat.h as hip_kernels/.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from fomoepy.errors import FomoeError
from fomoepy.runtime import kernels
from fomoepy.runtime.kernels import KernelSource
from fomoepy.runtime.shim import GpuError, PackedParams
from fomoepy.runtime.sim.build import SimCompiler
from fomoepy.runtime.sim.shim import SimShim

F32 = np.float32

TEST_KERNELS = r"""
#include "compat.h"

// every thread sums what all threads of the block wrote before the barrier
KERNEL void LAUNCH_BOUNDS(256) barrier_sum(const float* in, float* out) {
    SHARED(float, s, [256]);
    s[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < (int)blockDim.x; i++) t += s[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = t;
}

// warp w repeats a warp-wide sum w + 1 times (warps take different numbers of loop trips), then
// broadcasts lane 3's value; a block barrier separates the rounds from a cross-warp read
KERNEL void LAUNCH_BOUNDS(128) warp_rounds(const float* in, float* out, float* other) {
    SHARED(float, per_warp, [4]);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float v = in[threadIdx.x];
    for (int r = 0; r <= warp; r++) v = warp_sum(v);
    out[threadIdx.x] = SHFL(v + lane, 3);
    if (lane == 0) per_warp[warp] = v;
    __syncthreads();
    other[threadIdx.x] = per_warp[(warp + 1) % 4];
}

// reads the launch's dynamic shared memory before anything writes it
KERNEL void LAUNCH_BOUNDS(64) read_dynamic_shared(float* out, int n) {
    DYN_SHARED(float, dyn);
    if (threadIdx.x == 0) out[blockIdx.x] = dyn[n - 1];
    __syncthreads();
    dyn[threadIdx.x] = 1.0f;
}

// half of warp 0 shuffles while the other half waits at the block barrier
KERNEL void LAUNCH_BOUNDS(64) deadlock(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x % WARP < 16) v = SHFL_XOR(v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

// the second warp leaves before the barrier the first one reaches
KERNEL void LAUNCH_BOUNDS(64) barrier_after_exit(float* out) {
    if (threadIdx.x >= WARP) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// lane 5 leaves, then its neighbour reads it
KERNEL void LAUNCH_BOUNDS(32) shuffle_exited_lane(float* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = SHFL_XOR((float)threadIdx.x, 1);
}

// out[i] = in[i] + 1
KERNEL void LAUNCH_BOUNDS(256) add_one(const float* in, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + 1.0f;
}
"""
SIGNATURES = {"barrier_sum": "pp", "warp_rounds": "ppp", "read_dynamic_shared": "pi", "deadlock": "p",
              "barrier_after_exit": "p", "shuffle_exited_lane": "p", "add_one": "ppi"}  # fmt: skip


def build(flags: tuple[str, ...] = (), text: str = TEST_KERNELS, racecheck: bool | None = None, spelling: str = "cuda") -> bytes:
    headers = tuple((p.name, p.read_text()) for p in sorted(kernels.kernel_dir().glob("*.h")))
    return SimCompiler(flags, racecheck, spelling).compile(KernelSource("test", text, headers), "sim")


class Device:
    """A simulated device with the test kernels loaded (`signatures`: their launch codes); its own streams."""

    def __init__(self, binary: bytes, device: int = 0, signatures: dict[str, str] = SIGNATURES):
        self.rt = SimShim(device)
        self.module = self.rt.load_module(binary)
        self.stream = self.rt.stream()
        self.buffers: list[int] = []
        self.signatures = signatures

    def upload(self, x: np.ndarray, stream=None) -> int:
        ptr = self.rt.malloc(x.nbytes)
        self.buffers.append(ptr)
        self.rt.htod(ptr, x.ctypes.data, x.nbytes, stream or self.stream)
        self.rt.sync(stream or self.stream)
        return ptr

    def empty(self, n: int) -> int:
        ptr = self.rt.malloc(4 * n)
        self.buffers.append(ptr)
        self.rt.memset32(ptr, 0, n, self.stream)
        return ptr

    def download(self, ptr: int, n: int, dtype=F32) -> np.ndarray:
        out = np.empty(n, dtype)
        self.rt.dtoh(out.ctypes.data, ptr, out.nbytes, self.stream)
        self.rt.sync(self.stream)
        return out

    def launch(self, name: str, grid, block, *args, shared: int = 0, stream=None) -> None:
        params = PackedParams(self.signatures[name], args)
        self.rt.launch(self.rt.function(self.module, name), grid, block, shared, stream or self.stream, params.address)

    def close(self) -> None:
        self.rt.sync(self.stream)
        for ptr in self.buffers:
            self.rt.free(ptr)


@pytest.fixture(scope="module")
def binary() -> bytes:
    return build()


@pytest.fixture
def dev(binary):
    d = Device(binary)
    yield d
    d.close()


# -- the rules ----------------------------------------------------------------------------------------


def test_syncthreads_is_a_barrier_across_the_block(dev):
    x = np.random.default_rng(0).standard_normal(3 * 256).astype(F32)
    out = dev.empty(3 * 256)
    dev.launch("barrier_sum", (3,), (256,), dev.upload(x), out)
    got = dev.download(out, 3 * 256).reshape(3, 256)
    sums = np.array([np.float32(sum(np.float32(v) for v in row)) for row in x.reshape(3, 256)], F32)  # the kernel's order
    assert np.array_equal(got, np.repeat(sums[:, None], 256, axis=1))


def test_warp_shuffles_exchange_32_lanes_when_warps_take_different_trips(dev):
    """Warp w runs w + 1 warp sums: a barrier that only yields (HIP-CPU's) mixes the warps' rounds."""
    x = np.arange(128, dtype=F32) / 7
    out, other = dev.empty(128), dev.empty(128)
    dev.launch("warp_rounds", (1,), (128,), dev.upload(x), out, other)
    got, got_other = dev.download(out, 128), dev.download(other, 128)
    v = x.reshape(4, 32).astype(np.float64)
    expect = []
    for w in range(4):
        s = v[w].copy()
        for _ in range(w + 1):
            s = np.full(32, s.sum())
        expect.append(s)
    expect = np.array(expect)  # [4, 32]: every lane holds its warp's repeated sum
    np.testing.assert_allclose(got.reshape(4, 32), expect + 3, rtol=1e-5)  # lane 3's v + 3, broadcast
    np.testing.assert_allclose(got_other.reshape(4, 32), np.roll(expect[:, :1], -1, axis=0).repeat(32, 1), rtol=1e-5)


def test_dynamic_shared_memory_is_nan_before_each_block(dev):
    out = dev.empty(4)
    dev.launch("read_dynamic_shared", (4,), (64,), out, 64, shared=64 * 4)
    assert np.isnan(dev.download(out, 4)).all()  # even after block 0 wrote 1.0 everywhere


@pytest.mark.parametrize(
    "kernel,block,message",
    [
        ("deadlock", 64, r"kernel deadlock, block \(0,0,0\): deadlock: 32 thread\(s\) wait at __syncthreads\(\) \(first: thread 16\) and 32 in a warp shuffle"),
        ("barrier_after_exit", 64, r"kernel barrier_after_exit.*(__syncthreads\(\) reached after 32 of the block's 64 threads exited|returned while 32 thread\(s\) wait at __syncthreads)"),
        ("shuffle_exited_lane", 32, r"kernel shuffle_exited_lane.*(lane\(s\) have exited|lane returned while)"),
    ],
)  # fmt: skip
def test_a_broken_kernel_is_one_error_naming_it(binary, kernel, block, message):
    d = Device(binary)
    out = d.empty(block)
    d.launch(kernel, (1,), (block,), out)
    with pytest.raises(GpuError, match=message):
        d.rt.sync(d.stream)
    with pytest.raises(GpuError, match=kernel):  # sticky: the stream stays failed, as a faulted GPU context
        d.rt.sync(d.stream)


def test_a_block_over_the_launch_bound_is_refused(dev):
    out = dev.empty(512)
    with pytest.raises(GpuError, match="block of 512 threads exceeds its launch bound of 256"):
        dev.launch("barrier_sum", (1,), (512,), out, out)


def test_a_pointer_into_another_device_is_refused(binary):
    a, b = Device(binary, 0), Device(binary, 1)
    x = a.upload(np.ones(8, F32))
    y = b.empty(8)
    with pytest.raises(GpuError, match=r"kernel add_one on device 1: argument 0 .* is memory of device 0"):
        b.launch("add_one", (1,), (256,), x, y, 8)
    with pytest.raises(GpuError, match="not device memory"):
        b.launch("add_one", (1,), (256,), np.ones(8, F32).ctypes.data, y, 8)
    a.close()
    b.close()


def test_a_backend_frees_what_it_allocated(binary):
    """Weights, KV caches, the error flag and its pinned read-back buffer go when the backend goes."""
    import gc

    from fomoepy.runtime.gpu import GpuBackend

    rt = SimShim(3)
    before = rt.device_allocations()
    dev = GpuBackend("sim", 3)
    dev.upload(np.ones(1000, F32), exact=True)
    dev.zeros((64, 64))
    assert rt.device_allocations()[0] > before[0]
    pinned = dev._err_host
    del dev
    gc.collect()
    assert rt.device_allocations() == before
    with pytest.raises(GpuError, match="not a pinned host allocation"):
        rt.host_free(pinned)


def test_copies_outside_an_allocation_are_refused(dev):
    ptr = dev.empty(4)
    host = np.zeros(8, F32)
    with pytest.raises(GpuError, match="outside every device allocation"):
        dev.rt.htod(ptr, host.ctypes.data, 32, dev.stream)


def test_the_portable_context_switch_gives_the_same_results():
    """ucontext (what non-x86 machines use) against the assembly switch, on the barrier kernels."""
    x = np.random.default_rng(1).standard_normal(256).astype(F32)
    results = []
    for flags in ((), ("-DFOMOE_SIM_UCONTEXT",)):
        d = Device(build(flags))
        out, other = d.empty(128), d.empty(128)
        d.launch("warp_rounds", (1,), (128,), d.upload(x[:128]), out, other)
        s = d.empty(256)
        d.launch("barrier_sum", (1,), (256,), d.upload(x), s)
        results.append((d.download(out, 128), d.download(other, 128), d.download(s, 256)))
        d.close()
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_a_device_whose_warps_are_not_32_lanes_is_refused():
    """compat.h's WARP is the figure the runtime checks, and a device that reports another (a wave64
    GCN/CDNA card) is one clear error before any kernel is loaded."""
    from fomoepy.runtime.gpu import GpuBackend

    assert re.search(rf"^#define WARP {kernels.WARP_SIZE}$", (kernels.kernel_dir() / "compat.h").read_text(), re.MULTILINE)
    rt = SimShim(0)
    assert rt.warp_size == 32
    rt.warp_size = 64
    with pytest.raises(FomoeError, match=r"simulated device 0 .* runs warps of 64 lanes; fomoepy's kernels are built for 32"):
        GpuBackend("sim", rt=rt, binaries={})


# -- streams and events ---------------------------------------------------------------------------------


def test_a_copy_up_ordered_after_another_streams_copy_down_reads_what_it_wrote(binary, deferred):
    """Deferred, a copy to the host lands in host memory only when the host syncs its stream; a copy up
    that a device stream makes after waiting for an event recorded after that copy down reads its bytes
    (as a device's DMA does: a demoted expert copied down on one stream and up again on another). Without
    the wait it reads what the host memory held before, every time."""
    d = Device(binary)
    down, up = d.rt.stream(), d.rt.stream()
    n = 256
    fresh = np.arange(n, dtype=F32)
    src = d.upload(fresh)
    for with_wait in (True, False):
        host = np.zeros(n, F32)
        dst = d.upload(np.full(n, -1, F32))  # (synced: nothing of it still queued)
        downloaded = d.rt.event()
        d.rt.dtoh(host.ctypes.data, src, host.nbytes, down)
        d.rt.record(downloaded, down)
        if with_wait:
            d.rt.wait(up, downloaded)
        d.rt.htod(dst, host.ctypes.data, host.nbytes, up)
        d.rt.sync(up)
        got = d.download(dst, n)
        d.rt.sync(down)
        assert np.array_equal(host, fresh)  # the host's own view, once it synced the copy's stream
        assert np.array_equal(got, fresh if with_wait else np.zeros(n, F32))
    d.close()


def test_deferred_streams_run_only_what_an_event_orders(binary, deferred):
    """A kernel on the compute stream reads a buffer a copy stream fills: with the wait it sees the
    copy; without it, it reads what was there before, every time."""
    d = Device(binary)
    copy_stream = d.rt.stream()
    n = 1000
    fresh = np.arange(n, dtype=F32)
    src = d.empty(n)  # zeros
    out = d.empty(n)
    for with_wait in (True, False):
        d.rt.memset32(src, 0, n, d.stream)
        d.rt.sync(d.stream)
        copied = d.rt.event()
        d.rt.htod(src, fresh.ctypes.data, fresh.nbytes, copy_stream)
        d.rt.record(copied, copy_stream)
        if with_wait:
            d.rt.wait(d.stream, copied)
        d.launch("add_one", ((n + 255) // 256,), (256,), src, out, n)
        got = d.download(out, n)
        d.rt.sync(copy_stream)
        if with_wait:
            assert np.array_equal(got, fresh + 1)
        else:
            assert np.array_equal(got, np.ones(n, F32))
    d.close()


def test_event_sync_waits_for_the_recorded_work(binary, deferred):
    d = Device(binary)
    n = 4096
    x = d.upload(np.full(n, 2, F32))
    y = d.empty(n)
    done = d.rt.event()
    d.launch("add_one", (n // 256,), (256,), x, y, n)
    d.rt.record(done, d.stream)
    d.rt.event_sync(done)
    host = np.empty(n, F32)
    ctypes.memmove(host.ctypes.data, y, host.nbytes)  # device memory is host memory in the simulator
    assert (host == 3).all()
    d.close()


def test_deferred_streams_show_the_host_a_copy_only_once_it_syncs_the_copys_stream(binary, deferred):
    """A copy down on a side stream, awaited by the compute stream: syncing the compute stream runs
    the copy (the wait needs it) but does not show it to the host; a sync of the copy's own stream,
    or of an event recorded on it after the copy, does."""
    d = Device(binary)
    side = d.rt.stream()
    n = 256
    x = d.upload(np.arange(n, dtype=F32))
    for by_event in (False, True):
        host = np.zeros(n, F32)
        done = d.rt.event()
        d.rt.dtoh(host.ctypes.data, x, host.nbytes, side)
        d.rt.record(done, side)
        d.rt.wait(d.stream, done)
        d.rt.sync(d.stream)
        assert (host == 0).all()
        d.rt.event_sync(done) if by_event else d.rt.sync(side)
        assert np.array_equal(host, np.arange(n, dtype=F32))
    d.close()


def test_a_free_in_deferred_mode_runs_no_stream(binary, deferred):
    """A driver's free drains the device; deferred streams keep the freed block until the work queued
    before it has run, and run nothing for it, so no stream is synced by a free that has nothing to do
    with it. A use of the freed block after the free is refused."""
    d = Device(binary)
    n = 256
    x, y = d.upload(np.full(n, 2, F32)), d.empty(n)
    d.rt.sync(d.stream)
    d.launch("add_one", (1,), (256,), x, y, n)
    scratch = d.rt.malloc(4096)
    d.rt.free(scratch)
    host = np.empty(n, F32)
    ctypes.memmove(host.ctypes.data, y, host.nbytes)  # device memory is host memory in the simulator
    assert (host == 0).all()  # the launch has not run
    assert (d.download(y, n) == 3).all()
    with pytest.raises(GpuError, match="outside every device allocation"):
        d.rt.htod(scratch, host.ctypes.data, 16, d.stream)
    d.close()


# -- the launch ABI --------------------------------------------------------------------------------------

SIZES = {"p": 8, "i": 4, "l": 8, "f": 4, "d": 8, "D": 128}


def test_every_kernel_takes_the_parameters_the_launch_table_packs():
    """KERNEL_SIGNATURES against the C declarations as compiled: the sizes and which are pointers; and
    the module each kernel is looked up in (kernels.module_of) is the one that defines it."""
    rt = SimShim(0)
    compiler = SimCompiler()
    found = {}
    for source in kernels.load_sources():
        module = rt.load_module(kernels.compile_cached(compiler, source, "sim"))
        for name, sig in kernels.KERNEL_SIGNATURES.items():
            try:
                fn = rt.function(module, name)
            except GpuError:
                continue
            found[name] = rt.kernel_params(fn)
            assert kernels.module_of(name) == source.name, name
    assert sorted(found) == sorted(kernels.KERNEL_SIGNATURES)
    for name, (sizes, pointers, bound) in found.items():
        sig = kernels.KERNEL_SIGNATURES[name]
        assert sizes == [SIZES[c] for c in sig], name
        assert pointers == [c == "p" for c in sig], name
        assert bound in (32, 64, 128, 256), name
