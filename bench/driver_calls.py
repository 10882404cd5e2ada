"""What one driver call costs the host, by the path it takes: a MoE layer step makes about twenty
(launches, copies, event records and waits), so at 100 µs a step each must cost well under 5 µs.

For a kernel launch, an event record, a stream's wait on an event and a 4-byte copy up, the host time per
call through
    backend   the engine's own call (GpuBackend.launch, the shim's record/wait/htod): what a step pays
    shim      DriverShim.call on the binding (its status check and current-context check)
    binding   the cuda-python / hip-python function itself, arguments already converted
    ctypes    the driver library's C function through ctypes, the handles as plain integers
and, for scale, an empty Python function call on the same processor. Each figure is the median over
batches of calls, the device synchronised between batches (outside the timing) so the launch queue
never fills.

    python bench/driver_calls.py [--vendor cuda|hip] [--calls 200] [--batches 50] [--record]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from datetime import date

import numpy as np
from results import processor, publish

from fomoepy.errors import FomoeError
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.kernels import KERNEL_SIGNATURES

KERNEL = "sigmoid_gate_f32"  # a, gate, out, n: the smallest kernel, one block


def per_call_us(fn, calls: int, batches: int, settle) -> float:
    """Median µs per call of fn() over `batches` batches of `calls` calls, settle() between them."""
    samples = []
    for _ in range(batches):
        settle()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(samples))


def driver_library(dev: GpuBackend) -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1" if dev.rt.vendor == "cuda" else "libamdhip64.so")


def handle(obj) -> int:
    """A binding object's driver handle as an integer (cuda-python's objects convert with int())."""
    return int(obj) if not isinstance(obj, int) else obj


def measure(vendor: str, calls: int, batches: int) -> dict:
    dev = GpuBackend(vendor)
    rt = dev.rt
    n = 256
    a, gate, out = (dev.upload(np.zeros(n, np.float32)) for _ in range(3))
    args = (a.ptr, gate.ptr, out.ptr, n)
    assert KERNEL_SIGNATURES[KERNEL] == "pppl"
    dev.launch(KERNEL, (1,), n, *args)  # the function and its parameter block, looked up once
    fn, params, _, _ = dev._launchers[KERNEL]
    address = params.pack(args)
    stream, event = dev.stream, rt.event()
    host = np.zeros(1, np.float32)
    host_ptr = host.ctypes.data
    names = rt.names
    api = rt.api
    launch_fn, record_fn = getattr(api, names.launch), getattr(api, names.event_record)
    wait_fn, htod_fn = getattr(api, names.stream_wait_event), getattr(api, names.memcpy_htod)
    extra = rt.launch_extra
    lib = driver_library(dev)
    c_launch, c_record = getattr(lib, names.launch), getattr(lib, names.event_record)
    # the C name: cuda.h maps cuMemcpyHtoDAsync to its _v2 (64-bit device pointers); HIP has one
    c_wait = getattr(lib, names.stream_wait_event)
    c_htod = getattr(lib, names.memcpy_htod + ("_v2" if vendor == "cuda" else ""))
    vp, u32, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
    c_launch.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
    c_record.argtypes = [vp, vp]
    c_wait.argtypes = [vp, vp, u32]
    c_htod.argtypes = [ctypes.c_uint64, vp, sz, vp] if vendor == "cuda" else [vp, vp, sz, vp]
    for f in (c_launch, c_record, c_wait, c_htod):
        f.restype = ctypes.c_int
    h_fn, h_stream, h_event = handle(fn), handle(stream), handle(event)

    def checked(rc: int) -> None:
        if rc != 0:
            raise SystemExit(f"bench/driver_calls.py: a ctypes call failed with status {rc}")

    def settle() -> None:
        dev.synchronize()

    def empty() -> None:
        pass

    rows = {
        "launch": {
            "backend": lambda: dev.launch(KERNEL, (1,), n, *args),
            "shim": lambda: rt.launch(fn, (1,), (n,), 0, stream, address),
            "binding": lambda: launch_fn(fn, 1, 1, 1, n, 1, 1, 0, stream, address, extra),
            "ctypes": lambda: checked(c_launch(h_fn, 1, 1, 1, n, 1, 1, 0, h_stream, address, None)),
        },
        "event record": {
            "backend": lambda: rt.record(event, stream),
            "shim": lambda: rt.call(names.event_record, event, stream),
            "binding": lambda: record_fn(event, stream),
            "ctypes": lambda: checked(c_record(h_event, h_stream)),
        },
        "stream waits on event": {
            "backend": lambda: rt.wait(stream, event),
            "shim": lambda: rt.call(names.stream_wait_event, stream, event, 0),
            "binding": lambda: wait_fn(stream, event, 0),
            "ctypes": lambda: checked(c_wait(h_stream, h_event, 0)),
        },
        "copy up, 4 bytes": {
            "backend": lambda: rt.htod(a.ptr, host_ptr, 4, stream),
            "shim": lambda: rt.call(names.memcpy_htod, a.ptr, host_ptr, 4, stream),
            "binding": lambda: htod_fn(a.ptr, host_ptr, 4, stream),
            "ctypes": lambda: checked(c_htod(a.ptr, host_ptr, 4, h_stream)),
        },
    }
    result = {"device": rt.device_name, "vendor": vendor, "calls": calls, "batches": batches,
              "python call": per_call_us(empty, calls, batches, settle), "rows": {}}  # fmt: skip
    for op, paths in rows.items():
        result["rows"][op] = {path: per_call_us(f, calls, batches, settle) for path, f in paths.items()}
    settle()
    return result


def report(r: dict) -> str:
    lines = [
        f"### driver_calls — {date.today()} — {r['device']} ({r['vendor']}), host {processor()}",
        "",
        f"`python bench/driver_calls.py --vendor {r['vendor']} --calls {r['calls']} --batches {r['batches']}`: "
        f"host µs per call (median of batches); an empty Python call costs {r['python call']:.2f} µs here",
        "",
        "| call | backend | shim | binding | ctypes |",
        "|---|---|---|---|---|",
        *(f"| {op} | {p['backend']:.2f} | {p['shim']:.2f} | {p['binding']:.2f} | {p['ctypes']:.2f} |" for op, p in r["rows"].items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vendor", choices=("cuda", "hip"), default="cuda")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    try:
        measured = measure(args.vendor, args.calls, args.batches)
    except FomoeError as e:  # no driver: one line, as bench/gpu_kernels.py says it
        print(f"bench/driver_calls.py needs a GPU, or the stand-in driver (bench/standin.py): {e}", file=sys.stderr)
        return 2
    return publish(report(measured), args.record)


if __name__ == "__main__":
    sys.exit(main())
