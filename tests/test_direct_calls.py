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

from fomoepy.runtime.sim.build import standin_drivers

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
    out["normed"] = dev.to_host(dev.rms_norm(a, w, 1e-6))  # a launch
    return out


direct = run()
rt.direct = None  # the same calls through the binding's Python functions
python = run()
for name in direct:
    assert direct[name].tobytes() == python[name].tobytes(), name
assert (direct["copied"] == x).all() and (direct["memset"].view(np.uint32) == 0x9ABCDEF0).all()
print("SAME")
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


def run_script(standin: Path, vendor: str, script: str) -> subprocess.CompletedProcess:
    env = standin_environ(standin, vendor)
    return subprocess.run([sys.executable, "-c", script, vendor], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return standin_drivers(tmp_path_factory.mktemp("standin"))


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_each_direct_call_does_what_the_bindings_python_function_does(standin, vendor):
    proc = run_script(standin, vendor, SCRIPT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "SAME"


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
