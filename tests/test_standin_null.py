"""The stand-in driver's null mode (FOMOE_STANDIN_NULL=1), through the real cuda-python binding: what
bench/host_time.py times the host's own calls against. Memory is address space only, nothing runs, every
event is reached at once, and a call a real driver would refuse is still refused."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fomoepy.runtime.sim.build import standin_drivers

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import ctypes
import numpy as np
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.shim import GpuError

dev = GpuBackend("cuda")
rt = dev.rt
huge = rt.malloc(512 << 30)  # far more than this machine's memory: address space only
host = rt.host_alloc(1 << 20)
view = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 20)).from_address(host))
assert not view.any(), "pinned memory starts zeroed"
view[:] = 0xAB
rt.htod(huge, host, 1 << 20, dev.copy_stream)
rt.dtoh(host, huge + (1 << 30), 1 << 20, dev.copy_stream)  # nothing is read back
ev = rt.event()
rt.record(ev, dev.copy_stream)
rt.wait(dev.stream, ev)
rt.event_sync(ev)
rt.sync(dev.stream)
assert (view == 0xAB).all(), "a read-back changed the host bytes"
x = dev.upload(np.ones((1, 64), np.float32))
y = dev.rms_norm(x, np.ones(64, np.float32), 1e-6)  # a launch, checked and not run
try:
    rt.htod(huge + (600 << 30), host, 16, dev.copy_stream)
    print("COPY OUTSIDE ACCEPTED")
except GpuError as e:
    print("REFUSED", "outside every device allocation" in str(e))
try:
    dev.launch("rms_norm_f32", (1,), 256, host, 64, x.ptr, y.ptr, 1, 64, 1e-6)
    print("HOST POINTER ACCEPTED")
except GpuError as e:
    print("REFUSED", "is not device memory" in str(e))
# the pinned pool's chunks are the driver's own allocations here, address space only: mapping and
# populating pages to register them would commit a 397B host tier's memory on this machine
# (this process's own peak, VmHWM: getrusage's ru_maxrss also counts the forking pytest's before exec)
from fomoepy.runtime.pinned import PinnedPool
pool = PinnedPool(rt, [dev.copy_stream], chunk_bytes=2 << 30)
bufs = [pool.take(1 << 30) for _ in range(3)]
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("POOL", pool._registers, len(pool._mappings), peak_kib < (1 << 20))
"""


@pytest.mark.slow
def test_the_null_device_runs_nothing_holds_nothing_and_still_refuses_bad_calls(tmp_path):
    if importlib.util.find_spec("cuda") is None:
        pytest.skip("cuda-python is not installed")
    standin = standin_drivers(tmp_path / "standin")
    env = os.environ | {
        "LD_LIBRARY_PATH": str(standin), "FOMOE_STANDIN_MODULES": str(standin / "modules"),
        "FOMOE_STANDIN_NULL": "1", "FOMOE_STANDIN_DEVICES": "1", "FOMOE_STANDIN_MEMORY": str(1 << 40),
    }  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["REFUSED True", "REFUSED True", "POOL False 0 True"], proc.stdout
