"""The compiled parts of the package, each optional: without a C compiler the install goes on, and the
Python code they stand in for serves (the same results, more host time per step).

- fomoepy/experts/_cache_core.c: the expert cache's bookkeeping; without it fomoepy.experts.fast_cache
  falls back to the Python cache (the same decisions). -ffp-contract=off: the core must round as Python
  does (no fused multiply-adds), so its scores and their ties match the Python policies exactly. Its
  thread, which plans and commits beside a GPU step (_core_worker.h), is POSIX threads: -pthread.
- fomoepy/runtime/_driver_calls.c: a decode step's launches, copies and event calls through the GPU
  bindings' own C function pointers, and its tables and grouped launches each in one call (DecodeLaunch);
  without it fomoepy.runtime.shim calls the bindings' Python functions and fomoepy.runtime.gpu_launches
  makes the tables and launches in Python. It shares the tables' packing (_moe_pack.h) with _moe_tables.c.
  With it, fomoepy/runtime/_decode_experts.c: a step's device work on one GPU (GpuExperts's begin, compute,
  copies down and evictions) each in one call, and _resident_map.c: the device tier's slots by (layer,
  expert) in an array per layer; without them, GpuExperts's own Python and a dict.
- fomoepy/runtime/_moe_tables.c: the grouped-launch tables of a decode step and of several rows (a batched
  step, a prefill chunk) packed in C; without it fomoepy.runtime.moe_tables packs them in Python (the same bytes).
- fomoepy/runtime/_host_memory.c: a host buffer's address, and a pinned buffer lent out that goes back to
  its pool when dropped, each in one call; the cpu device's read arena (a buffer taken and given back in one
  call each) and the arena buffer a read's record landed in (record_index); without it
  fomoepy.runtime.pinned does the first two through ctypes and fomoepy.runtime.ggml_reads the others in Python.
- fomoepy/experts/_reads.c: a read in flight's state and asks (done, result, landed...) each one C call;
  without it fomoepy.experts.reads.PyRead (the same semantics, a Python frame each).
- fomoepy/experts/_acquire.c: a step's reads issued and its plan taken and committed
  (ExpertStreamer.start_acquire) in one C call; without it the Python method, its definition.
- fomoepy/runtime/_ggml_rounds.c: the cpu backend's decode round (a row's copy, its picks' slots, ggml's
  graph, the outputs set at their places) in one call, and the weighted sum of a step's picks' outputs in
  one loop, also as one node of a decode graph with the residual added; without it the same graphs run
  from numpy, numpy sums, and the graphs take ggml's nodes (the same bits). -ffp-contract=off: the sum
  rounds each product to float32 before adding it, as numpy's and ggml's do.
- fomoepy/runtime/_batched_experts.c: the cpu backend's decode-step experts, each expert's K-quant weights decoded
  once for all the rows that picked it (fomoepy.runtime.batched_experts); OpenMP (-fopenmp), ggml's CPU runtime.
  Without it, or on a CPU without AVX-512, ggml's products serve: the same arithmetic, its float sums in
  another order (so not the same bits), and slower.
- fomoepy/runtime/_row_attention.c: every decode row's attention over its own KV cache, a batch's rows in one graph
  node (fomoepy.runtime.row_attention). -O3 -ffp-contract=off: its vector forms round as its scalar loop.
  Without it, ggml's attention nodes serve decode rows (the bits of prefill's; a batch then takes five
  nodes a sequence and layer).
- fomoepy/runtime/_dense_rows.c: a decode batch's Q8_0 dense products, each weight block read once for all its
  rows, each row's bits its lone one-row product's (fomoepy.runtime.dense_rows). Without it, or on a CPU
  without AVX2, ggml's one-row products serve: the same bits, slower.
"""

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wno-missing-braces"]
FIELDS = ("fomoepy/runtime/_ggml_fields.h",)  # the graph nodes' reads of ggml_tensor fields


def optional(module: str, *flags: str, depends: tuple[str, ...] = (), more: tuple[str, ...] = ()) -> Extension:
    """One compiled part, from the C file named like its module and any `more` (and the headers they include,
    `depends`: a change to one rebuilds it): built where a C compiler is; where not, the install goes on and
    the Python code it stands in for serves."""
    source = module.replace(".", "/") + ".c"
    return Extension(module, [source, *more], depends=list(depends), extra_compile_args=["-O2", "-std=c11", *flags, *WARNINGS],
                     extra_link_args=[f for f in flags if f in ("-pthread", "-fopenmp")], optional=True)  # fmt: skip


setup(
    ext_modules=[
        optional("fomoepy.experts._cache_core", "-ffp-contract=off", "-pthread", depends=("fomoepy/experts/_core_worker.h",)),
        optional("fomoepy.runtime._driver_calls", depends=("fomoepy/runtime/_moe_pack.h", "fomoepy/runtime/_driver_calls.h"),
                 more=("fomoepy/runtime/_decode_experts.c", "fomoepy/runtime/_resident_map.c")),
        optional("fomoepy.runtime._moe_tables", depends=("fomoepy/runtime/_moe_pack.h",)),
        optional("fomoepy.runtime._host_memory"),
        optional("fomoepy.experts._reads"),
        optional("fomoepy.experts._acquire"),
        optional("fomoepy.runtime._ggml_rounds", "-ffp-contract=off", depends=FIELDS),
        optional("fomoepy.runtime._batched_experts", "-O3", "-fopenmp", depends=FIELDS),
        optional("fomoepy.runtime._dense_rows", "-O3", depends=FIELDS),
        optional("fomoepy.runtime._row_attention", "-O3", "-ffp-contract=off", depends=FIELDS),
    ]
)
