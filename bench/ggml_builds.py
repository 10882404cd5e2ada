"""Two ggml builds on the same products: which library computes the bench model's shapes faster.

Each library directory (a `ggml` package with lib/libggml-base.so and lib/libggml-cpu.so, e.g. an
install of ggml-python or of ggml-py) is loaded in a child process of its own (two builds of one
library share symbol names and sonames: one process can hold only one) and driven through raw ctypes
on exported C functions whose signatures both share, never through the package's Python module, so
the same calls time both. The children run interleaved, `--repeats` times each; the table gives
medians of the per-call compute times.

Cases (the bench model of bench/cpu_decode.py: n_embd 1024, expert_ff 512, gate/up Q4_K, down Q6_K,
64 experts top-8):
- `gate 1 tok`: a Q4_K [512, 1024] product with one token; `down 1 tok`: Q6_K [1024, 512];
- `gate 128 tok`: the Q4_K product with 128 tokens (a prefill chunk);
- `layer 1 tok` / `layer 128 tok`: one layer's routed experts, gate and up by `ggml_mul_mat_id` over
  a [1024, 512, 64] tensor, SwiGLU, down by `ggml_mul_mat_id` over [512, 1024, 64], 8 experts a token;
- each in a plain CPU buffer and in the CPU backend's extra (repacking) buffer type, where the
  library has one (`…, repacked`).

    python bench/ggml_builds.py --lib DIR [--lib DIR ...] [--threads N] [--repeats 5] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import date

from results import publish

K_EMBD, FF, N_EXPERT, TOP_K = 1024, 512, 64, 8
Q4_K, Q6_K, F32, I32 = 12, 14, 0, 26


def child(libdir: str, threads: int, calls: int) -> dict:
    """Times every case on the library in `libdir`; {case: median seconds per compute}."""
    import ctypes as C
    import time

    import numpy as np

    base = C.CDLL(os.path.join(libdir, "lib", "libggml-base.so"), mode=C.RTLD_GLOBAL)
    cpu = C.CDLL(os.path.join(libdir, "lib", "libggml-cpu.so"), mode=C.RTLD_GLOBAL)
    vp, i64 = C.c_void_p, C.c_int64

    class InitParams(C.Structure):
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", vp), ("no_alloc", C.c_bool)]

    class Cplan(C.Structure):  # ggml-cpu.h, the same in both builds
        _fields_ = [("work_size", C.c_size_t), ("work_data", vp), ("n_threads", C.c_int), ("threadpool", vp),
                    ("abort_callback", vp), ("abort_callback_data", vp), ("use_ref", C.c_bool)]  # fmt: skip

    def fn(lib, name, res, *args):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, list(args)
        return f

    init = fn(base, "ggml_init", vp, InitParams)
    free = fn(base, "ggml_free", None, vp)
    new2 = fn(base, "ggml_new_tensor_2d", vp, vp, C.c_int, i64, i64)
    new3 = fn(base, "ggml_new_tensor_3d", vp, vp, C.c_int, i64, i64, i64)
    get_data = fn(base, "ggml_get_data", vp, vp)
    nbytes = fn(base, "ggml_nbytes", C.c_size_t, vp)
    mul_mat = fn(base, "ggml_mul_mat", vp, vp, vp, vp)
    mul_mat_id = fn(base, "ggml_mul_mat_id", vp, vp, vp, vp, vp)
    silu = fn(base, "ggml_silu", vp, vp, vp)
    mul = fn(base, "ggml_mul", vp, vp, vp, vp)
    new_graph = fn(base, "ggml_new_graph", vp, vp)
    expand = fn(base, "ggml_build_forward_expand", None, vp, vp)
    quantize = fn(base, "ggml_quantize_chunk", C.c_size_t, C.c_int, vp, vp, i64, i64, i64, vp)
    row_size = fn(base, "ggml_row_size", C.c_size_t, C.c_int, i64)
    alloc_from_buft = fn(base, "ggml_backend_alloc_ctx_tensors_from_buft", vp, vp, vp)
    tensor_set = fn(base, "ggml_backend_tensor_set", None, vp, vp, C.c_size_t, C.c_size_t)
    plan_graph = fn(cpu, "ggml_graph_plan", Cplan, vp, C.c_int, vp)
    compute = fn(cpu, "ggml_graph_compute", C.c_int, vp, C.POINTER(Cplan))
    cpu_reg = fn(cpu, "ggml_backend_cpu_reg", vp)
    reg_dev = fn(base, "ggml_backend_reg_dev_get", vp, vp, C.c_size_t)
    proc = fn(base, "ggml_backend_reg_get_proc_address", vp, vp, C.c_char_p)
    cpu_buft = fn(cpu, "ggml_backend_cpu_buffer_type", vp)
    supports_op = fn(base, "ggml_backend_dev_supports_op", C.c_bool, vp, vp)

    reg = cpu_reg()
    dev = reg_dev(reg, 0)
    extra_fn = proc(reg, b"ggml_backend_dev_get_extra_bufts")
    repack = None
    if extra_fn:
        bufts = C.CFUNCTYPE(C.POINTER(vp), vp)(extra_fn)(dev)
        repack = bufts[0] if bufts and bufts[0] else None

    def repacks(qtype, cols, rows):
        """llama.cpp's test: does the device compute a product from a weight in the repacking buffer?
        (types without repacked kernels for this CPU must stay in a plain buffer)."""
        ctx = init(InitParams(64 * 1024, None, True))
        w = new2(ctx, qtype, cols, rows)
        keep.append(alloc_from_buft(ctx, repack))
        ok = supports_op(dev, mul_mat(ctx, w, new2(ctx, F32, cols, 1)))
        free(ctx)
        return ok

    rng = np.random.default_rng(0)
    keep = []

    def quantized(qtype, rows, cols, mats=1):
        x = rng.standard_normal((mats * rows, cols)).astype(np.float32)
        out = np.empty(row_size(qtype, cols) * rows * mats, np.uint8)
        quantize(qtype, x.ctypes.data, out.ctypes.data, 0, mats * rows, cols, None)
        return out

    def weights_ctx(specs, buft):
        """Weight tensors [(qtype, cols, rows, mats)] in a buffer of `buft` (if it repacks their type)."""
        ts = []
        for q, c, r, m in specs:
            ctx = init(InitParams(64 * 1024, None, True))
            ts.append(new3(ctx, q, c, r, m))
            keep.append(alloc_from_buft(ctx, buft if buft == cpu_buft() or repacks(q, c, r) else cpu_buft()))
        for t, (q, c, r, m) in zip(ts, specs):
            data = quantized(q, r, c, m)
            assert data.nbytes == nbytes(t)
            tensor_set(t, data.ctypes.data, 0, data.nbytes)  # a repacking buffer repacks here
        return ts

    def timed(build, n_tensors_mem):
        ctx = init(InitParams(n_tensors_mem, None, False))
        gf = new_graph(ctx)
        for out in build(ctx):
            expand(gf, out)
        plan = plan_graph(gf, threads, None)
        work = np.empty(max(plan.work_size, 1), np.uint8)
        plan.work_data = work.ctypes.data
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            if compute(gf, C.byref(plan)) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            times.append(time.perf_counter() - t)
        free(ctx)
        return statistics.median(times[calls // 5 :])  # the first calls warm the caches

    def activations(ctx, cols, rows, mats=1):
        t = new3(ctx, F32, cols, rows, mats)
        a = np.frombuffer((C.c_float * (cols * rows * mats)).from_address(get_data(t)), np.float32)
        a[:] = rng.standard_normal(a.size).astype(np.float32)
        return t

    def routed_ids(ctx, tokens):
        t = new2(ctx, I32, TOP_K, tokens)
        ids = np.frombuffer((C.c_int32 * (TOP_K * tokens)).from_address(get_data(t)), np.int32)
        ids[:] = np.concatenate([rng.choice(N_EXPERT, TOP_K, replace=False) for _ in range(tokens)])
        return t

    results = {}
    mem = 256 << 20
    for tag, buft in (("plain", cpu_buft()), ("repacked", repack)):
        if tag == "repacked" and buft is None:
            continue
        gate, down = weights_ctx([(Q4_K, K_EMBD, FF, 1), (Q6_K, FF, K_EMBD, 1)], buft)
        gate_e, up_e, down_e = weights_ctx(
            [(Q4_K, K_EMBD, FF, N_EXPERT), (Q4_K, K_EMBD, FF, N_EXPERT), (Q6_K, FF, K_EMBD, N_EXPERT)], buft
        )
        for tokens in (1, 128):
            results[f"gate {tokens} tok, {tag}"] = timed(lambda ctx, T=tokens: [mul_mat(ctx, gate, activations(ctx, K_EMBD, T))], mem)
        results[f"down 1 tok, {tag}"] = timed(lambda ctx: [mul_mat(ctx, down, activations(ctx, FF, 1))], mem)

        def layer(ctx, T):
            h = activations(ctx, K_EMBD, 1, T)  # [D, 1, T]: each token one row, read by all its experts
            ids = routed_ids(ctx, T)
            a = mul_mat_id(ctx, gate_e, h, ids)  # [FF, top-k, T]
            b = mul_mat_id(ctx, up_e, h, ids)
            return [mul_mat_id(ctx, down_e, mul(ctx, silu(ctx, a), b), ids)]  # [D, top-k, T]

        for tokens in (1, 128):
            results[f"layer {tokens} tok, {tag}"] = timed(lambda ctx, T=tokens: layer(ctx, T), mem)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, help="a ggml package directory (repeatable)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each library")
    ap.add_argument("--calls", type=int, default=50, help="computes per case in one run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads, args.calls)))
        return 0

    runs: dict[str, list[dict]] = {lib: [] for lib in args.lib}
    for _ in range(args.repeats):
        for lib in args.lib:
            out = subprocess.run([sys.executable, __file__, "--lib", lib, "--child", lib, "--threads", str(args.threads),
                                  "--calls", str(args.calls)], capture_output=True, text=True, check=False)  # fmt: skip
            if out.returncode != 0:
                sys.exit(f"{lib}: {(out.stderr.strip().splitlines() or ['exit ' + str(out.returncode)])[-1]}")
            runs[lib].append(json.loads(out.stdout))
    cases = list(runs[args.lib[0]][0])
    names = [f"{version(lib)} ({lib})" for lib in args.lib]
    lines = [f"| case | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for case in cases:
        cells = []
        for lib in args.lib:
            vals = [r[case] for r in runs[lib] if case in r]
            cells.append(f"{statistics.median(vals) * 1e6:.0f} µs" if vals else "—")
        lines.append(f"| {case} | {' | '.join(cells)} |")
    report = (
        f"### ggml_builds — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/ggml_builds.py {' '.join('--lib ' + lib for lib in args.lib)} --threads {args.threads} "
        f"--repeats {args.repeats} --calls {args.calls}`; median µs per compute over {args.repeats} interleaved runs\n\n"
        + "\n".join(lines) + "\n"
    )  # fmt: skip
    return publish(report, args.record)


def version(libdir: str) -> str:
    """The library's own ggml_version() (the C library's, not the binding's)."""
    import ctypes as C

    out = subprocess.run([sys.executable, "-c", "import ctypes as C,sys; f=C.CDLL(sys.argv[1]).ggml_version; "
                          "f.restype=C.c_char_p; print(f().decode())", os.path.join(libdir, "lib", "libggml-base.so")],
                         capture_output=True, text=True, check=False)  # fmt: skip
    del C
    return f"ggml {out.stdout.strip() or '?'}"


if __name__ == "__main__":
    sys.exit(main())
