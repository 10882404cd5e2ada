"""The engine's configuration: one frozen, validated `EngineOptions`, and the command-line flags that
make it (every command that opens a model: generate, logits, serve, ppl, profile, demo).

A flag's path is at most three files: its definition and field here (`add_engine_options`,
`EngineOptions.from_args`, checked once in `__post_init__`), then the module that acts on it, which
reads it off the options object it is given rather than from a copy. For example:

    -t/--threads   options -> runtime/backends.open_backends (cpu_threads) -> runtime/ggml_cpu.GgmlBackend
    --car-*        experts/car (flags, CarConfig) -> options -> experts/streamer (car.cache_aware_route)
    --ram-cache    options -> engine (ExpertCache's sizes) -> experts/cache
    --vram-cache   options (refused on the cpu backend, here, before anything loads) -> engine -> experts/cache
    --cache-policy options -> engine (make_policy for each tier; whether evictions demote) -> experts/policy
    --repack-experts options -> engine (auto: whether the tier holds the whole model) -> runtime/backends (GgmlExperts)

The flag names are a contract: other programs pass them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from fomoepy.errors import FomoeError
from fomoepy.experts.car import CarConfig
from fomoepy.experts.policy import DEFAULT_POLICY, POLICIES
from fomoepy.runtime.names import BACKEND_NAMES
from fomoepy.scheduler import PLACEMENTS

BACKFILL_MODES = ("off", "thread", "sync")  # reload CAR's substituted originals: never, in a thread, N per token
REPACK_MODES = ("auto", "on", "off")  # --repack-experts: the cpu backend's slot form
EXPERT_KERNELS = ("auto", "on", "ggml")  # --expert-kernel: the cpu backend's decode-step experts
# ggml's own limit (GGML_MAX_N_THREADS, its threadpool's cpumask size): more threads than this it
# cannot run, and asking the OS for tens of thousands fails (OpenMP) or crashes (ggml's pool)
MAX_THREADS = 512


@dataclass(frozen=True)
class EngineOptions:
    backend: str = "reference"  # the exact engine for library callers and tests; the CLI defaults to cpu (ggml)
    n_ctx: int | None = None  # None: the model's training context
    threads: int | None = None  # CPU threads (ggml, BLAS); None: automatic (backends.cpu_threads)
    devices: int = 1  # devices the layers are placed on
    placement: str = "pingpong"  # pingpong | blocks | one device index per layer
    profile_timing: bool = False
    store: tuple[str, ...] = ()  # expert store directories; empty: read experts from the GGUF (mmap)
    vram_cache: int | None = None  # device tier bytes (reference: compute-ready experts; cpu: 0); None: automatic
    ram_cache: int | None = None  # host tier bytes (store-form experts; cpu: its one tier, ggml slots); None: automatic
    cache_policy: str = DEFAULT_POLICY
    car: CarConfig = field(default_factory=CarConfig)  # validated by CarConfig itself
    backfill: str = "thread"
    backfill_per_token: int = 4
    prefetch: bool = True
    freq_profile: str | None = None
    trace: str | None = None
    prefill_chunk: int = 64  # prompt tokens per prefill step (a running stream's gap is one such step)
    repack_experts: str = "auto"  # cpu backend: expert slots in ggml's repacked form: on, off, auto (when the tier holds every expert)
    expert_kernel: str = "auto"  # cpu backend: a decode step's experts by fomoepy's batched kernel: where measured faster (auto), wherever it runs (on), or ggml's
    sequences: int = 1  # sequences whose states (full-context KV caches, recurrent states) a GPU keeps room for (fomoe serve: --max-batch)

    def __post_init__(self) -> None:
        def bad(flag: str, why: str):
            raise FomoeError(f"--{flag} {why}")

        if self.backend not in BACKEND_NAMES:
            bad("backend", f"{self.backend!r} is not available (available: {', '.join(BACKEND_NAMES)})")
        if self.n_ctx is not None and self.n_ctx < 1:
            bad("ctx-size", f"must be >= 1, got {self.n_ctx}")
        if self.backend == "cpu" and self.vram_cache:
            bad("vram-cache", "must be 0 on the cpu backend: its one tier is ggml slots in host memory, sized by --ram-cache "
                "(--backend reference keeps a float32 device tier)")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            bad("threads", f"must be in [1, {MAX_THREADS}], got {self.threads}")
        if self.devices < 1:
            bad("devices", f"must be >= 1, got {self.devices}")
        if self.placement not in PLACEMENTS and not all(t.strip().isdigit() for t in self.placement.split(",")):
            bad("placement", f"must be {', '.join(PLACEMENTS)} or one device index per layer (e.g. 0,0,1,1), got {self.placement!r}")
        for flag, size in (("vram-cache", self.vram_cache), ("ram-cache", self.ram_cache)):
            if size is not None and size < 0:
                bad(flag, f"must be >= 0, got {size}")
        if self.repack_experts not in REPACK_MODES:
            bad("repack-experts", f"must be one of {', '.join(REPACK_MODES)}, got {self.repack_experts!r}")
        if self.expert_kernel not in EXPERT_KERNELS:
            bad("expert-kernel", f"must be one of {', '.join(EXPERT_KERNELS)}, got {self.expert_kernel!r}")
        if self.cache_policy not in POLICIES:
            bad("cache-policy", f"{self.cache_policy!r} is unknown (known: {', '.join(POLICIES)})")
        if self.backfill not in BACKFILL_MODES:
            bad("backfill", f"must be one of {', '.join(BACKFILL_MODES)}, got {self.backfill!r}")
        if self.backfill_per_token < 0:
            bad("backfill-per-token", f"must be >= 0, got {self.backfill_per_token}")
        if self.prefill_chunk < 1:
            bad("prefill-chunk", f"must be >= 1, got {self.prefill_chunk}")
        if self.sequences < 1:
            bad("max-batch", f"must be >= 1, got {self.sequences}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        from fomoepy.experts.sizes import parse_size

        return cls(
            backend=args.backend,
            n_ctx=args.ctx_size,
            threads=args.threads,
            devices=args.devices,
            placement=args.placement,
            profile_timing=args.profile_timing,
            store=tuple(args.store),
            vram_cache=None if args.vram_cache is None else parse_size(args.vram_cache),
            ram_cache=None if args.ram_cache is None else parse_size(args.ram_cache),
            cache_policy=args.cache_policy,
            car=CarConfig.from_args(args),
            backfill=args.backfill,
            backfill_per_token=args.backfill_per_token,
            prefetch=not args.no_prefetch,
            freq_profile=args.freq_profile,
            trace=args.trace,
            prefill_chunk=args.prefill_chunk,
            repack_experts=args.repack_experts,
            expert_kernel=args.expert_kernel,
            sequences=getattr(args, "max_batch", 1),  # (fomoe serve's; one sequence elsewhere)
        )

    @property
    def backfills(self) -> bool:
        """Whether CAR's substituted originals are read back into the host tier (which then needs one)."""
        return self.car.enabled and self.backfill != "off"

    def settings(self) -> dict:
        """Every field as plain values (CAR's flattened), e.g. for a resume file's header; n_ctx is left
        to the caller, which records it in its own terms."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "car":
                out.update({f"car_{k.name}": getattr(value, k.name) for k in fields(value)})
            elif f.name not in ("n_ctx", "sequences"):  # (sequences: room kept, no result changes with it)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=list(BACKEND_NAMES),
                   help="compute backend: cpu (ggml on the quantized weights), reference (exact numpy), cuda, hip, "
                        "sim (the GPU kernels run on a simulated device on the CPU: slow, for debugging), "
                        "auto (a GPU if one works, else cpu)")  # fmt: skip
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--devices", type=int, default=1, help="devices to place the layers on")
    p.add_argument("--placement", default="pingpong",
                   help="pingpong (layer L on device L mod N), blocks, or one device index per layer: 0,0,1,1")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=64, metavar="N",
                   help="prompt tokens evaluated per prefill step (default 64): the daemon runs other requests' "
                        "decode steps between chunks")  # fmt: skip
    p.add_argument("--profile-timing", action="store_true", help="host time per MoE layer by phase, on stderr at the end")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for ggml (as llama.cpp's -t), or numpy's BLAS on --backend reference (default: by model size)")
    g = p.add_argument_group("expert streaming")
    g.add_argument("--store", nargs="+", metavar="DIR", default=[], help="expert store directories (fomoe prepare)")
    g.add_argument(
        "--vram-cache", metavar="SIZE", default=None,
        help="device tier, e.g. 0, 48K, 512M, 16G (0 = off; reference backend: compute-ready float32 experts; cpu backend: 0 only); default: automatic",
    )  # fmt: skip
    g.add_argument("--ram-cache", metavar="SIZE", default=None,
                   help="host (DRAM) tier of store bytes (cpu backend: its one tier, experts in ggml slots); default: automatic")  # fmt: skip
    g.add_argument("--cache-policy", default=DEFAULT_POLICY, help=f"eviction policy: {', '.join(POLICIES)} (default {DEFAULT_POLICY})")
    g.add_argument("--freq-profile", metavar="F", default=None, help=".freq profile that seeds VRAM, then DRAM")
    g.add_argument("--trace", metavar="FILE", default=None, help="record every routing decision (for fomoe simulate)")
    g.add_argument("--no-prefetch", action="store_true", help="do not predict and prefetch the next layer's experts")
    g.add_argument("--repack-experts", default="auto", choices=list(REPACK_MODES),
                   help="cpu backend: hold the expert slots in ggml's repacked form, as llama.cpp does unless --no-repack: "
                        "on, off, or auto (default: on when the tier holds every expert, filled at load; off when it "
                        "streams, where every expert a step streams through would be repacked first; off "
                        "where --expert-kernel auto serves)")  # fmt: skip
    g.add_argument("--expert-kernel", default="auto", choices=list(EXPERT_KERNELS),
                   help="cpu backend: a decode step's experts by fomoepy's kernel, which decodes each expert once for "
                        "all the sequences that picked it, where it has the experts' types (Q4_K, Q6_K) and the CPU "
                        "has AVX-512, where it was measured faster (auto, the default); on a CPU with AVX2 too (on: "
                        "its AVX2 form, not measured on an AVX2-only CPU); or by ggml's products (ggml)")  # fmt: skip
    g = p.add_argument_group("cache-aware routing (off by default: the exact model)")
    CarConfig.add_arguments(g)
    g.add_argument("--backfill", default="thread", choices=list(BACKFILL_MODES),
                   help="reload substituted originals: in a background thread, or N per token (repeatable)")  # fmt: skip
    g.add_argument("--backfill-per-token", type=int, default=4, metavar="N", help="with --backfill sync")
