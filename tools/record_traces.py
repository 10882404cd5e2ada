#!/usr/bin/env python3
"""Record the packed token-by-token routing traces that cache policies are judged on (profiles/traces/).

Each text is tokenized and evaluated one token at a time (as decoding does), in windows of the model's
context, with the exact router (CAR off). Deterministic: the same model and text give the same file.

    demo-heldout   the demo model over its held-out text (22 standard-library files it never trained on):
                   what policies are scored on
    demo-project   the demo model over this project's own Python sources: what a policy may be tuned on

and, unpacked, the trace `fomoe plan` measures the engine's next-layer prediction on (its records
carry what the engine predicted for each step a layer earlier, most confident first):

    fomoepy/plan/traces/demo-predictions.trace   the demo model over the first 512 held-out tokens

    python tools/record_traces.py [--out profiles/traces] [--plan-trace PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from fomoepy.data import demo_heldout_path, demo_model_path
from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts import trace_pack
from fomoepy.experts.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]


def project_text() -> str:
    files = sorted((ROOT / "fomoepy").rglob("*.py"))
    return "".join(f.read_text() for f in files)


def record(model: str, text: str, out: Path, max_tokens: int, packed: bool = True) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "t.trace" if packed else out
        engine = Engine(model, EngineOptions(trace=str(raw), vram_cache=0, prefetch=False))
        tokens = engine.tokenizer.encode(text, add_special=False, parse_special=False)[:max_tokens]
        t0 = time.perf_counter()
        window = engine.n_ctx
        for start in range(0, len(tokens), window):
            state = engine.new_state()
            for token in tokens[start : start + window]:
                engine.decode_token(state, int(token))
        engine.close()
        if packed:
            trace_pack.save(out, read_trace(raw))
        print(f"{out}: {len(tokens)} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "profiles" / "traces")
    ap.add_argument("--max-tokens", type=int, default=12_000)
    ap.add_argument("--plan-trace", type=Path, default=ROOT / "fomoepy" / "plan" / "traces" / "demo-predictions.trace")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(demo_model_path())
    record(model, Path(demo_heldout_path()).read_text(), args.plan_trace, 512, packed=False)
    record(model, Path(demo_heldout_path()).read_text(), args.out / "demo-heldout.npz", args.max_tokens)
    record(model, project_text(), args.out / "demo-project.npz", args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
