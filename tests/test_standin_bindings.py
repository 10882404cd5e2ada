"""The real bindings driven end to end: cuda-python and hip-python load stand-in driver libraries
(fomoepy/runtime/sim/standin.cpp) that run the simulated device, and the GPU tests run through them.

cuda-python opens libcuda.so.1 and asks cuGetProcAddress_v2 for every entry point; hip-python opens
libamdhip64.so by that name and dlsyms each function; both are found on LD_LIBRARY_PATH, which the
loader reads at start, so each run is a pytest in a fresh process. The kernels are compiled as on a
real machine (NVRTC for sm_90, Debian's hiprtc for gfx1030); the stand-in checks each code object's
target and kernels, and runs the simulator's build of the same source with the packed arguments the
binding passed: built with compat.h's HIP branch under hip-python, its CUDA branch under cuda-python.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fomoepy.runtime.sim.build import standin_drivers

ROOT = Path(__file__).resolve().parents[1]
BINDINGS = {"cuda": "cuda.bindings", "hip": "hip"}
# two architectures at a device tier that both hits and misses, and ping-pong; every model and tier
# size runs on the simulated device itself (test_gpu_model.py)
MODEL_SUBSET = "qwen35moe_q4_k-0.3 or qwen3moe_q4_k_m-0.3 or pingpong"
# "cuda" or "hip": the scripts these tests run go to that vendor's real driver, not the stand-in
REAL_DRIVER = os.environ.get("FOMOEPY_TEST_REAL_DRIVER", "")


def hiprtc_dir() -> str | None:
    out = subprocess.run(["bash", str(ROOT / "tools" / "setup_kernel_compilers.sh")], capture_output=True, text=True)
    found = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("hiprtc: ")]
    return found[0] if found else None


def modules(standin: Path, vendor: str) -> str:
    """The simulator's builds a vendor's stand-in runs: with that vendor's spellings (standin_drivers)."""
    return str(standin / ("modules-hip" if vendor == "hip" else "modules"))


def standin_environ(standin: Path | None, vendor: str) -> dict[str, str]:
    """This process's environment with the loader finding `vendor`'s stand-in driver (and, for HIP,
    Debian's hiprtc); skips where the binding or the compiler is not here. Where FOMOEPY_TEST_REAL_DRIVER
    names the vendor (bench/gpu_checks.sh on a machine with a GPU), the environment as it is: the same
    scripts and checks over the real driver; the other vendor's are skipped there."""
    if importlib.util.find_spec(BINDINGS[vendor].split(".")[0]) is None:
        pytest.skip(f"{BINDINGS[vendor]} is not installed")
    if REAL_DRIVER:
        if vendor != REAL_DRIVER:
            pytest.skip(f"FOMOEPY_TEST_REAL_DRIVER={REAL_DRIVER}: {vendor}'s stand-in is not run beside the real driver")
        return dict(os.environ)
    paths = [str(standin)]
    if vendor == "hip":
        lib = hiprtc_dir()
        if lib is None:
            pytest.skip("Debian's hiprtc is not available (tools/setup_kernel_compilers.sh failed)")
        paths.append(lib)
    return os.environ | {
        "LD_LIBRARY_PATH": ":".join(paths + [os.environ.get("LD_LIBRARY_PATH", "")]),
        "FOMOE_STANDIN_MODULES": modules(standin, vendor),
    }


def run_pytest(standin: Path, vendor: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = standin_environ(standin, vendor) | {"FOMOEPY_TEST_GPU": vendor} | env
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=1200)


def assert_ran(proc: subprocess.CompletedProcess, at_least: int) -> None:
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "skipped" not in summary, summary  # every selected test ran on the stand-in device
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= at_least, summary


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_the_gpu_tests_pass_through_the_real_binding(standin, vendor):
    ops = run_pytest(standin, vendor, "-m", "gpu", "tests/test_gpu_ops.py")
    assert_ran(ops, 60)
    model = run_pytest(standin, vendor, "-m", "gpu", "-k", MODEL_SUBSET, "tests/test_gpu_model.py")
    assert_ran(model, 3)  # two model runs and ping-pong over two stand-in devices


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_with_deferred_streams_a_missing_wait_fails(standin, vendor):
    """Each stream runs only what a sync or an event needs, and the host sees a copy down only once it
    syncs that copy's stream: the model is right with the copy wait and wrong without it, steps issued
    back to back compute what steps read one by one, and demoted experts reach the host tier once their
    copies are synced (test_sim_placement.py)."""
    proc = run_pytest(standin, vendor, "tests/test_sim_placement.py", "-k", "ordered or back_to_back or demoted", FOMOE_STANDIN_DEFERRED="1")
    assert_ran(proc, 3)


@pytest.mark.slow
def test_a_rocm5_runtime_is_one_clear_error_and_auto_falls_back(tmp_path):
    """hip-python 7.2 over a runtime without hipGetDevicePropertiesR0600 (ROCm 5): --backend hip is one
    error saying what is needed, --backend auto computes on the CPU after one line saying why."""
    if importlib.util.find_spec("hip") is None:
        pytest.skip("hip-python is not installed")
    standin = standin_drivers(tmp_path / "rocm5", rocm5=True)
    (standin / "libcuda.so.1").unlink()  # a machine with an AMD GPU only
    env = os.environ | {"LD_LIBRARY_PATH": str(standin), "FOMOE_STANDIN_MODULES": str(standin / "modules")}
    model = ROOT / "fomoepy" / "data" / "demo-qwen3moe.gguf"
    hip = subprocess.run([sys.executable, "-m", "fomoepy.cli", "generate", str(model), "--backend", "hip", "-n", "2", "-p", "Hi"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert hip.returncode != 0
    assert "Traceback" not in hip.stderr
    assert "hip-python 7.2, which needs ROCm >= 6 (>= 6.4 for RDNA4)" in hip.stderr
    assert "hipGetDevicePropertiesR0600" in hip.stderr or "hipGetDeviceProperties" in hip.stderr
    auto = subprocess.run([sys.executable, "-m", "fomoepy.cli", "generate", str(model), "--backend", "auto", "-n", "2", "-p", "Hi"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert auto.returncode == 0, auto.stderr[-2000:]
    why = [line for line in auto.stderr.splitlines() if "backend auto: using the CPU" in line]
    assert len(why) == 1 and "ROCm >= 6" in why[0], auto.stderr[-2000:]


CHECK_CODE_OBJECT = r"""
import sys
from fomoepy.runtime import kernels
from fomoepy.runtime.shim import open_runtime

vendor = sys.argv[1]
rt = open_runtime(vendor)
compiler = kernels.compiler_for(vendor)
rope = next(s for s in kernels.load_sources() if s.name == "rope")
rt.load_module(compiler.compile(rope, rt.arch))
widened = rope.text.replace("int n_past, double base", "long long n_past, double base")
assert widened != rope.text
try:
    rt.load_module(compiler.compile(kernels.KernelSource("rope", widened, rope.headers), rt.arch))
    print("LOADED")
except Exception as e:
    print("REFUSED", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_code_object_whose_parameters_differ_from_the_source_is_refused(standin, vendor, tmp_path):
    """The stand-in reads the parameters from the code object (a cubin's .nv.info, AMDGPU's metadata
    note) and refuses one that does not match the simulator's build of the source."""
    script = tmp_path / "check.py"
    script.write_text(CHECK_CODE_OBJECT)
    if importlib.util.find_spec(BINDINGS[vendor].split(".")[0]) is None:
        pytest.skip(f"{BINDINGS[vendor]} is not installed")
    paths = [str(standin)] + ([hiprtc_dir() or ""] if vendor == "hip" else [])
    env = os.environ | {"LD_LIBRARY_PATH": ":".join(paths), "FOMOE_STANDIN_MODULES": modules(standin, vendor)}
    proc = subprocess.run([sys.executable, str(script), vendor], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout and "rope_neox_f32: the code object's parameter sizes [ 8 8 8 8 4 4 4 4 8 8 8 ]" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_device_with_64_lane_warps_is_one_clear_error(standin, vendor):
    """The stand-in reports a warp of 32 lanes (the runs above pass only so: the backend checks it) and
    here 64, as a GCN/CDNA card: --backend names the warp size and the 32 the kernels are built for."""
    if importlib.util.find_spec(BINDINGS[vendor].split(".")[0]) is None:
        pytest.skip(f"{BINDINGS[vendor]} is not installed")
    paths = [str(standin)] + ([hiprtc_dir() or ""] if vendor == "hip" else [])
    env = os.environ | {"LD_LIBRARY_PATH": ":".join(paths), "FOMOE_STANDIN_MODULES": modules(standin, vendor), "FOMOE_STANDIN_WARP": "64"}
    model = ROOT / "fomoepy" / "data" / "demo-qwen3moe.gguf"
    proc = subprocess.run([sys.executable, "-m", "fomoepy.cli", "generate", str(model), "--backend", vendor, "-n", "2", "-p", "Hi"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "runs warps of 64 lanes; fomoepy's kernels are built for 32" in proc.stderr, proc.stderr[-2000:]
