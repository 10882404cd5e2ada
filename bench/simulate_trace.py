"""Cache policies against Belady's optimum on a routing trace recorded from a real run.

Records a trace (`--trace`) while the model generates from a few prompts, then replays it with
`fomoe simulate` at several cache capacities, given as fractions of all routed-expert bytes (store
form). Uses the shipped demo model when it exists (trained, so its routing is skewed the way real
models' is), else the mid-size random bench model (near-uniform routing: a hard case for caches).

    python bench/simulate_trace.py [--model M.gguf] [--tokens 256] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

from fomoepy.cli import main as fomoe
from fomoepy.engine import Engine, EngineOptions
from fomoepy.sampling import SamplingParams
from results import record

HERE = Path(__file__).parent
FRACTIONS = [(0.05, 0.10), (0.10, 0.25), (0.25, 0.25), (0.50, 0.25)]


def default_model() -> Path:
    try:
        from fomoepy.data import demo_model_path

        path = Path(demo_model_path())
        if path.exists():
            return path
    except ImportError:
        pass
    from fomoepy.devtools.make_test_model import make_model

    path = HERE / "models" / "bench-qwen3moe.gguf"  # the model bench/cpu_decode.py builds
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, preset="bench-qwen3moe")
    return path


def record_trace(model: Path, trace: Path, n_tokens: int) -> tuple[int, int]:
    engine = Engine(model, EngineOptions(trace=str(trace), vram_cache=0))
    rng = np.random.default_rng(0)
    produced = 0
    while produced < n_tokens:
        prompt = engine.tokenizer.encode("def main(argv):\n    ") or [0]
        prompt = prompt + rng.integers(0, engine.spec.n_vocab - 3, size=4).tolist()
        out = list(engine.generate(prompt, 32, SamplingParams(temperature=0.8, seed=produced), stop_at_eog=False))
        produced += len(prompt) + len(out)
    total = sum(layer.expert_nbytes for layer in engine.source.layers) * engine.spec.moe.n_expert
    engine.close()
    return produced, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=256, help="tokens to run while recording")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    model = args.model or default_model()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "run.trace"
        n_tokens, total = record_trace(model, trace, args.tokens)
        rows = []
        for dev_frac, host_frac in FRACTIONS:
            vram, ram = int(total * dev_frac), int(total * host_frac)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                fomoe(["simulate", str(trace), "--vram", str(vram), "--ram", str(ram), "--policy", "all", "--json"])
            out = json.loads(buf.getvalue())
            for name, p in out["policies"].items():
                rows.append(
                    f"| {dev_frac:.0%} + {host_frac:.0%} | {name} | {p['device']['hit_rate']:.1%} | "
                    f"{out['belady_device_hit_rate']:.1%} | {p['memory_hit_rate']:.1%} | {out['belady_memory_hit_rate']:.1%} |"
                )
    report = (
        f"### simulate_trace — {date.today()}\n\n"
        f"`python bench/simulate_trace.py --tokens {args.tokens}`; model `{model.name}`, trace of {n_tokens} tokens; "
        f"capacities as fractions of all routed-expert bytes ({total / 1e6:.1f} MB). "
        "memory = served by device or host; Belady memory uses device + host capacity.\n\n"
        "| VRAM + DRAM | policy | device hit | Belady | memory hit | Belady |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(report)
    if args.record:
        record(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
