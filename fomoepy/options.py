"""Engine options shared by every command that opens a model (generate, logits, serve, ppl, ...).

The flag names are a contract: other programs pass them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.experts.policy import DEFAULT_POLICY, POLICIES
from fomoepy.runtime.select import BACKEND_NAMES


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=list(BACKEND_NAMES),
                   help="compute backend: cpu (ggml on the quantized weights), reference (exact numpy), cuda, hip, "
                        "sim (the GPU kernels run on a simulated device on the CPU: slow, for debugging), "
                        "auto (a GPU if one works, else cpu)")  # fmt: skip
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--devices", type=int, default=1, help="logical devices to place the layers on")
    p.add_argument("--placement", default="pingpong",
                   help="pingpong (layer L on device L mod N), blocks, or one device index per layer: 0,0,1,1")  # fmt: skip
    p.add_argument("--profile-timing", action="store_true", help="host time per MoE layer by phase, on stderr at the end")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for ggml (as llama.cpp's -t) and numpy's BLAS (default: by model size)")
    g = p.add_argument_group("expert streaming")
    g.add_argument("--store", nargs="+", metavar="DIR", default=[], help="expert store directories (fomoe prepare)")
    g.add_argument(
        "--vram-cache", metavar="SIZE", default=None,
        help="device tier, e.g. 0, 48K, 512M, 16G (0 = off; reference backend: compute-ready float32 experts; cpu backend: 0 only); default: automatic",
    )  # fmt: skip
    g.add_argument("--ram-cache", metavar="SIZE", default=None, help="host (DRAM) tier of store bytes; default: automatic")
    g.add_argument("--cache-policy", default=DEFAULT_POLICY, help=f"eviction policy: {', '.join(POLICIES)} (default {DEFAULT_POLICY})")
    g.add_argument("--freq-profile", metavar="F", default=None, help=".freq profile that seeds VRAM, then DRAM")
    g.add_argument("--trace", metavar="FILE", default=None, help="record every routing decision (for fomoe simulate)")
    g.add_argument("--no-prefetch", action="store_true", help="do not predict and prefetch the next layer's experts")
    g = p.add_argument_group("cache-aware routing (off by default: the exact model)")
    g.add_argument("--car-threshold", type=float, default=None, metavar="T",
                   help="substitute a cached expert when p(substitute)/p(original) >= T")  # fmt: skip
    g.add_argument("--car-dampen", action="store_true", help="a substitute weighs its own probability, not the original's")
    g.add_argument("--car-warmup", type=int, default=0, metavar="N", help="no substitution for the first N tokens")
    g.add_argument("--car-protect-first", type=int, default=0, metavar="N", help="no substitution in the first N layers")
    g.add_argument("--car-protect-last", type=int, default=0, metavar="N", help="no substitution in the last N layers")
    g.add_argument("--backfill", default="thread", choices=["off", "thread", "sync"],
                   help="reload substituted originals: in a background thread, or N per token (repeatable)")  # fmt: skip
    g.add_argument("--backfill-per-token", type=int, default=4, metavar="N", help="with --backfill sync")


def engine_options(args: argparse.Namespace):
    from fomoepy.engine import EngineOptions
    from fomoepy.experts.car import CarConfig
    from fomoepy.experts.policy import POLICIES
    from fomoepy.experts.sizes import parse_size

    if args.cache_policy not in POLICIES:
        raise FomoeError(f"--cache-policy {args.cache_policy!r} is unknown (known: {', '.join(POLICIES)})")
    if args.backfill_per_token < 0:
        raise FomoeError(f"--backfill-per-token must be >= 0, got {args.backfill_per_token}")
    return EngineOptions(
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
        car=CarConfig(
            threshold=args.car_threshold,
            dampen=args.car_dampen,
            warmup_tokens=args.car_warmup,
            protect_first=args.car_protect_first,
            protect_last=args.car_protect_last,
        ),
        backfill=args.backfill,
        backfill_per_token=args.backfill_per_token,
        prefetch=not args.no_prefetch,
        freq_profile=args.freq_profile,
        trace=args.trace,
    )


def open_engine(args: argparse.Namespace):
    """An Engine for args.model (the demo model when none is given) with the parsed engine options."""
    from fomoepy.engine import Engine

    resolve_model(args)
    return Engine(args.model, engine_options(args))


def resolve_model(args: argparse.Namespace) -> bool:
    """No MODEL given: use the embedded demo model, reading its experts from a store prepared on
    first use in the user's cache directory. Returns whether the demo model was chosen."""
    if getattr(args, "model", None):
        return False
    from fomoepy.data import demo_model_path

    try:
        path = demo_model_path()
    except FileNotFoundError as e:
        raise FomoeError(f"no MODEL given and the embedded demo model is missing ({e})") from None
    args.model = str(path)
    if not getattr(args, "store", None):
        args.store = [str(ensure_demo_store(path))]
    return True


def ensure_demo_store(model: Path) -> Path:
    """The demo model's expert store under $XDG_CACHE_HOME/fomoepy (made, or finished, on first use).

    The directory name carries a digest of the model file and the store format's version, so a new demo
    model, or a new format, gets a new store."""
    import hashlib
    import sys

    from fomoepy.experts.store_format import MANIFEST_NAME
    from fomoepy.experts.store_format import VERSION as STORE_VERSION
    from fomoepy.experts.store_writer import prepare_store

    digest = hashlib.sha256()
    with open(model, "rb") as f:
        digest.update(f.read(1 << 20))
    digest.update(str(model.stat().st_size).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    store = cache / "fomoepy" / "stores" / f"{model.stem}-{digest.hexdigest()[:12]}-v{STORE_VERSION}"
    if not (store / MANIFEST_NAME).exists():
        print(f"fomoe: preparing the demo model's expert store in {store} (first use)", file=sys.stderr)
        prepare_store(model, [store], progress=False)
    return store
