"""The hot driver calls made through the bindings' C function pointers (fomoepy/runtime/_driver_calls.c):
under both real bindings, over the stand-in drivers, each call does what the binding's Python function
does, bit for bit, and a call the driver refuses is one GpuError naming the call and the driver's reason.
The GPU tests through the real bindings (test_standin_bindings.py) run the whole engine on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_standin_bindings import standin_environ


ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
import numpy as np
from fomoepy.runtime import _driver_calls
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.shim import GpuError

dev = GpuBackend(sys.argv[1])
rt = dev.rt
assert isinstance(rt.direct, _driver_calls.Calls), "the binding's C functions are not in use"
# the calls a step makes by the dozen are the C functions themselves, no Python method around them
from fomoepy.runtime.shim import BOUND_DIRECT
assert all(getattr(rt, name) == getattr(rt.direct, name) for name in BOUND_DIRECT), "a Python method wraps a direct call"
rng = np.random.default_rng(7)
x = rng.standard_normal((3, 256)).astype(np.float32)
w = rng.standard_normal(256).astype(np.float32)


def run() -> dict:
    out = {}
    a = dev.upload(x)
    b = dev.empty(x.shape)
    rt.dtod(b.ptr, a.ptr, x.nbytes, dev.stream)  # a copy on the device
    out["copied"] = dev.to_host(b)  # a copy down, after a synchronisation
    c = dev.empty((64,), np.int32)
    rt.memset32(c.ptr, 0x9ABCDEF0, 64, dev.stream)  # a pattern past 2^31: signed in HIP, unsigned in CUDA
    out["memset"] = dev.to_host(c)
    ev = rt.event()
    rt.record(ev, dev.stream)
    rt.wait(dev.copy_stream, ev)
    rt.event_sync(ev)
    for copy in (rt.htod, rt.dtoh, rt.dtod):
        copy(0, 0, 0, dev.stream)  # nothing to copy: no call (a null pointer is never handed to the driver)
    out["normed"] = dev.to_host(dev.rms_norm(a, w, 1e-6))  # a launch
    return out


direct = run()
assert isinstance(dev._compiled.get("rms_norm_f32"), _driver_calls.Launcher), "the launch was not compiled"
rt.direct = None  # the same calls through the binding's Python functions
assert "htod" not in vars(rt), "the direct calls are still the shim's methods"
python = run()
for name in direct:
    assert direct[name].tobytes() == python[name].tobytes(), name
assert (direct["copied"] == x).all() and (direct["memset"].view(np.uint32) == 0x9ABCDEF0).all()
print("SAME")
"""

LAUNCHER = r"""
import sys
import numpy as np
from fomoepy.runtime import _driver_calls
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.shim import GpuError

vendor = sys.argv[1]
devs = [GpuBackend(vendor, 0), GpuBackend(vendor, 1)]
rng = np.random.default_rng(3)
x = rng.standard_normal((2, 64)).astype(np.float32)
w = rng.standard_normal(64).astype(np.float32)
arrays = [(d.upload(x), d.upload(w), d.empty(x.shape)) for d in devs]


def norm(d, xs, ws, ys, eps=0.5):  # (an eps that moves every output: its float32 slot is checked too)
    d.launch("rms_norm_f32", (2,), 256, xs.ptr, 64, ws.ptr, ys.ptr, 2, 64, eps)


for d, (xs, ws, ys) in zip(devs, arrays):
    norm(d, xs, ws, ys)  # the first launch of each: its compiled launcher is made
assert all(isinstance(d._compiled["rms_norm_f32"], _driver_calls.Launcher) for d in devs)
out = [d.to_host(ys).copy() for d, (_, _, ys) in zip(devs, arrays)]
# device 1's launch, then device 0's with no other call between: the launcher makes its device current
for d, (xs, ws, ys) in list(zip(devs, arrays))[::-1]:
    norm(d, xs, ws, ys, 2.0)
again = [d.to_host(ys) for d, (_, _, ys) in zip(devs, arrays)]
# the same through the shim's launch (a direct call, not a launcher): device 1's, then device 0's
for d, (xs, ws, ys) in list(zip(devs, arrays))[::-1]:
    fn, params, _, _ = d._launchers["rms_norm_f32"]
    d.rt.launch(fn, (2,), (256,), 0, d.stream, params.pack((xs.ptr, 64, ws.ptr, ys.ptr, 2, 64, 2.0)))
shim_launched = [d.to_host(ys) for d, (_, _, ys) in zip(devs, arrays)]
assert all(a.tobytes() == b.tobytes() for a, b in zip(again, shim_launched))
devs[0].rt.direct = None  # the binding's Python functions, for comparison
xs, ws, ys = arrays[0]
norm(devs[0], xs, ws, ys, 2.0)
python = devs[0].to_host(ys)
print("SAME" if out[0].tobytes() == out[1].tobytes() and again[0].tobytes() == again[1].tobytes() == python.tobytes()
      and again[0].tobytes() != out[0].tobytes() else "DIFFERENT")
d = devs[1]
try:  # a refused launch: the driver's reason, naming the call
    d.launch("rms_norm_f32", (2,), 256, 16, 64, ws.ptr, ys.ptr, 2, 64, 1e-6)
    print("ACCEPTED")
except GpuError as e:
    print(e)
try:  # an argument that is not the kernel's type
    d.launch("rms_norm_f32", (2,), 256, arrays[1][0].ptr, 64, arrays[1][1].ptr, arrays[1][2].ptr, 2.5, 64, 1e-6)
    print("ACCEPTED")
except TypeError as e:
    print("TypeError")
"""

REFUSED = r"""
import sys
import numpy as np
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.shim import GpuError

dev = GpuBackend(sys.argv[1])
assert dev.rt.direct is not None
try:
    dev.rt.htod(16, dev.upload(np.ones(4, np.float32)).ptr, 16, dev.copy_stream)
    print("ACCEPTED")
except GpuError as e:
    print(e)
"""

CHANGED = r"""
import sys
import numpy as np
from fomoepy.runtime.gpu import GpuBackend

vendor = sys.argv[1]
if vendor == "hip":
    from hip import chip as binding
    from fomoepy.runtime.shim_hip import HIP_SIGNATURES as signatures
else:
    from cuda.bindings import cydriver as binding
    from fomoepy.runtime.shim_cuda import CUDA_SIGNATURES as signatures
dev = GpuBackend(vendor)
rt = dev.rt
# a binding whose launch takes other arguments than the ones the C helper passes: not called directly
launch = rt.names.launch
changed = dict(signatures, **{launch: signatures[launch].replace("void **, void **", "void **")})
rt.direct = None
rt.use_direct_calls(binding.__pyx_capi__, changed)
print("KEPT PYTHON" if rt.direct is None else "DIRECT")
x = np.arange(8, dtype=np.float32)
print("SAME" if (dev.to_host(dev.upload(x)) == x).all() else "DIFFERENT")  # the Python functions serve
rt.use_direct_calls(binding.__pyx_capi__, signatures)
print("DIRECT" if rt.direct is not None else "KEPT PYTHON")
"""


def run_script(standin: Path, vendor: str, script: str, **env: str) -> subprocess.CompletedProcess:
    """`script` in a process whose bindings load the stand-in drivers of `vendor` (argv[1]), with `env` added."""
    env = standin_environ(standin, vendor) | env
    return subprocess.run([sys.executable, "-c", script, vendor], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def script_lines(standin: Path, vendor: str, script: str, **env: str) -> list[str]:
    """run_script's printed lines, the script required to have exited cleanly (its output's tail otherwise)."""
    proc = run_script(standin, vendor, script, **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_each_direct_call_does_what_the_bindings_python_function_does(standin, vendor):
    proc = run_script(standin, vendor, SCRIPT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "SAME"


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_compiled_launch_gives_the_python_launchs_bits_on_its_own_device_and_refusals_raise(standin, vendor):
    """A kernel's compiled launcher (packs its arguments and launches in one C call) gives the bits the
    binding's Python function gives; a launch right after another device's makes its own device current;
    a launch the driver refuses is one GpuError with its reason; an argument of the wrong type, a TypeError."""
    proc = run_script(standin, vendor, LAUNCHER)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "SAME", lines
    call = {"cuda": "cuLaunchKernel", "hip": "hipModuleLaunchKernel"}[vendor]
    assert lines[1].startswith(f"{vendor}: {call} failed: ") and "is not device memory" in lines[1], lines[1]
    assert lines[2] == "TypeError", lines


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_refused_direct_call_is_one_error_naming_the_call_and_the_reason(standin, vendor):
    proc = run_script(standin, vendor, REFUSED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    call = {"cuda": "cuMemcpyHtoDAsync", "hip": "hipMemcpyHtoDAsync"}[vendor]
    line = proc.stdout.strip()
    assert line.startswith(f"{vendor}: {call} failed: ") and "outside every device allocation" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_binding_whose_c_function_changed_is_called_through_its_python_one(standin, vendor):
    """Cython names each exported function by its C signature: one that is not what the C helper passes is
    not called from it (its arguments would be wrong), and the binding's Python functions serve."""
    proc = run_script(standin, vendor, CHANGED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["KEPT", "PYTHON", "SAME", "DIRECT"], proc.stdout
