"""The stand-in driver's timed null mode (FOMOE_STANDIN_NULL=1 with FOMOE_STANDIN_KERNEL_BW and
FOMOE_STANDIN_LINK_BW), through the real cuda-python binding: the emulated-cost device that
bench/plan_fidelity.py --emulated decodes on. Each stream is a timeline: a copy takes bytes / link,
a launch the bytes it reads / kernel rate, streams overlap, an event wait orders them, and a sync
makes the host wait until the device's time.

Bounds: an event's time is the virtual time of its stream, so an interval between two events is the
ops' cost plus the host's own time between issuing them (the stream was idle in between), which the
script measures around its calls: cost <= elapsed <= cost + issue time (+ the float milliseconds'
rounding, 1e-4 relative). A sync returns no earlier than the device's time; two 100 ms ops on two
streams are synced in under 150 ms (overlapping: 100 ms plus the host's delays; in turn: 200 ms).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fomoepy.runtime.sim.build import standin_drivers

ROOT = Path(__file__).resolve().parents[1]
KERNEL_BW, LINK_BW = 2e9, 1e9  # bytes/s: a 100 MB copy takes 100 ms, a 200 MB read by a kernel 100 ms
N = 100_000_000

SCRIPT = r"""
import json, time
import numpy as np
from fomoepy.runtime import kernels
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.gpu_arrays import BufferPool
from fomoepy.quants import row_nbytes
from gguf import GGMLQuantizationType as Q

N, out = __N__, {}
dev = GpuBackend("cuda")
rt, s, c = dev.rt, dev.stream, dev.copy_stream
rt.sync(s)
dst = rt.malloc(N)
host = rt.host_alloc(N)
ev = [rt.event(timing=True) for _ in range(6)]

def issued(fn):  # seconds of host time spent issuing
    t = time.perf_counter(); fn(); return time.perf_counter() - t

# a copy of N bytes: its interval on the copy stream, and how long a sync of it holds the host
t0 = time.perf_counter()
gap = issued(lambda: (rt.record(ev[0], c), rt.htod(dst, host, N, c), rt.record(ev[1], c)))
rt.sync(c)
out["copy"] = {"elapsed_ms": rt.elapsed_ms(ev[0], ev[1]), "issue_s": gap, "sync_wall_s": time.perf_counter() - t0}

# a read-back: the host waits for it at the stream sync
t0 = time.perf_counter()
rt.dtoh(host, dst, N, s)
rt.sync(s)
out["readback_wall_s"] = time.perf_counter() - t0

# a launch reading an exact 2N-byte weight: x [1, K] -> y [1, rows]
K = 1024
rows = 2 * N // (4 * K)
w = dev.upload(np.zeros((rows, K), np.float32), exact=True)  # charged at the link, on the compute stream
x = dev.upload(np.zeros((1, K), np.float32))
rt.sync(s)
t0 = time.perf_counter()
gap = issued(lambda: (rt.record(ev[2], s), dev.linear(x, w), rt.record(ev[3], s)))
rt.event_sync(ev[3])
out["launch"] = {"elapsed_ms": rt.elapsed_ms(ev[2], ev[3]), "issue_s": gap, "sync_wall_s": time.perf_counter() - t0,
                 "bytes": w.nbytes + BufferPool.size_class(4 * K) + BufferPool.size_class(4 * rows)}

# a grouped expert launch: the matrices it reads through its work list, from its arguments
D, F, n_work = 4096, 1024, 10
rb = row_nbytes(Q.Q4_K, D)
work, act = dev.empty((64 * n_work,), np.uint8), dev.empty((n_work, F))
name = kernels.kernel_name("moe_gate_up", Q.Q4_K) + "_t1"
gap = issued(lambda: (rt.record(ev[2], s), dev.launch(name, (F // 4, n_work), 128, work.ptr, x.ptr, D, F, n_work, rb, act.ptr),
                      rt.record(ev[3], s)))
rt.sync(s)
out["experts"] = {"elapsed_ms": rt.elapsed_ms(ev[2], ev[3]), "issue_s": gap,
                  "bytes": 2 * n_work * F * rb + sum(BufferPool.size_class(n) for n in (64 * n_work, 4 * K, 4 * n_work * F))}

# two streams: a copy and a launch of 100 ms each, issued together, overlap
t0 = time.perf_counter()
rt.htod(dst, host, N, c)
dev.linear(x, w)
rt.sync(c)
rt.sync(s)
out["overlap_wall_s"] = time.perf_counter() - t0

# an event orders them: the launch waits for the copy
gap = issued(lambda: (rt.record(ev[4], c), rt.htod(dst, host, N, c), rt.record(ev[5], c), rt.wait(s, ev[5]),
                      dev.linear(x, w), rt.record(ev[3], s)))
rt.sync(s)
out["ordered"] = {"elapsed_ms": rt.elapsed_ms(ev[4], ev[3]), "issue_s": gap}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def timed(tmp_path_factory) -> dict:
    if importlib.util.find_spec("cuda") is None:
        pytest.skip("cuda-python is not installed")
    standin = standin_drivers(tmp_path_factory.mktemp("standin"))
    env = os.environ | {
        "LD_LIBRARY_PATH": str(standin), "FOMOE_STANDIN_MODULES": str(standin / "modules"), "FOMOE_STANDIN_NULL": "1",
        "FOMOE_STANDIN_DEVICES": "1", "FOMOE_STANDIN_MEMORY": str(1 << 40),
        "FOMOE_STANDIN_KERNEL_BW": str(KERNEL_BW), "FOMOE_STANDIN_LINK_BW": str(LINK_BW),
        "FOMOE_STANDIN_TIMELINE": str(tmp_path_factory.mktemp("timeline") / "ops.txt"),
    }  # fmt: skip
    script = SCRIPT.replace("__N__", str(N))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["timeline"] = [line.split() for line in Path(env["FOMOE_STANDIN_TIMELINE"]).read_text().splitlines()]
    return out


def within(interval: dict, cost: float) -> None:
    """cost <= elapsed <= cost + the host's time issuing the calls between the two events."""
    elapsed = interval["elapsed_ms"] / 1e3
    assert cost * (1 - 1e-4) <= elapsed <= (cost + interval["issue_s"]) * (1 + 1e-4), (elapsed, cost, interval)


@pytest.mark.slow
def test_a_copy_of_n_bytes_takes_n_over_the_link_and_the_sync_waits_for_it(timed):
    within(timed["copy"], N / LINK_BW)
    assert timed["copy"]["sync_wall_s"] >= N / LINK_BW
    assert timed["readback_wall_s"] >= N / LINK_BW  # a read-back returns when the device is done


@pytest.mark.slow
def test_a_launch_takes_the_bytes_it_reads_over_the_kernel_rate(timed):
    within(timed["launch"], timed["launch"]["bytes"] / KERNEL_BW)
    assert timed["launch"]["sync_wall_s"] >= timed["launch"]["bytes"] / KERNEL_BW
    within(timed["experts"], timed["experts"]["bytes"] / KERNEL_BW)  # what its work list names


@pytest.mark.slow
def test_two_streams_overlap(timed):
    one = N / LINK_BW  # the copy and the launch take this long each (the launch reads 2N at 2x the rate)
    assert one <= timed["overlap_wall_s"] < 1.5 * one  # in turn, it would be 2x


@pytest.mark.slow
def test_an_event_wait_orders_the_streams(timed):
    launch = timed["launch"]["bytes"] / KERNEL_BW
    within(timed["ordered"], N / LINK_BW + launch)  # overlapping, it would be max(copy, launch)


@pytest.mark.slow
def test_the_timeline_file_holds_each_op_where_the_device_placed_it(timed):
    # FOMOE_STANDIN_TIMELINE: <stream> <kind> <submitted> <start> <end> per op, "host W <from> <done>
    # <returned>" per synchronisation, in steady-clock ns
    ops = [(stream, kind, *map(int, rest)) for stream, kind, *rest in timed["timeline"] if stream != "host"]
    waits = [tuple(map(int, rest)) for stream, kind, *rest in timed["timeline"] if stream == "host"]
    assert all(a <= b <= c for _, _, a, b, c in ops) and all(a <= b <= c for a, b, c in waits)
    # (an op's span is its cost in seconds cast to whole steady-clock ns: within 1 ns of 5e7 to 1e8 ns, so
    # 1e-6 relative holds with a hundredfold margin on any machine)
    copies = [op for op in ops if op[1] == "U" and (op[4] - op[3]) == pytest.approx(N / LINK_BW * 1e9, rel=1e-6)]
    launches = [op for op in ops if op[1] == "L" and (op[4] - op[3]) == pytest.approx(timed["launch"]["bytes"] / KERNEL_BW * 1e9, rel=1e-6)]
    assert len(copies) == 3 and len(launches) == 3  # the copy, the overlapping pair, the ordered pair
    assert any(op[1] == "D" for op in ops) and any(op[1] == "E" for op in ops)  # the read-back; events
    assert launches[1][3] < copies[1][4]  # the pair on two streams overlaps
    assert launches[2][3] == copies[2][4] and launches[2][0] != copies[2][0]  # the event wait: the launch starts as the copy ends
    assert any(done >= copies[0][4] for _, done, _ in waits)  # a sync waited for the first copy
