"""How far each backend's logits are from the exact ones and from llama.cpp's, on every oracle model.

The oracle fixtures (tests/fixtures/oracle/) hold, per tiny model, its tokens, the exact float64 logits
and llama.cpp's own logits. The `reference` backend (numpy, float32 on dequantised weights) computes
the exact function, so its distance to the exact logits is rounding; the `cpu` backend (ggml) rounds
activations to Q8 blocks as llama.cpp does, so it is compared with llama.cpp, next to the distance
between the exact logits and llama.cpp's. The tests bound these (tests/test_oracle_logits.py,
tests/test_ggml_cpu.py); this prints the figures themselves.

    python bench/logit_distance.py [--record]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import numpy as np
from results import publish

from fomoepy.engine import Engine, EngineOptions

ORACLE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "oracle"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    names = sorted(json.loads((ORACLE / "MANIFEST.json").read_text())["models"])
    lines = [
        f"### logit_distance — {date.today()} — oracle models",
        "",
        "`python bench/logit_distance.py`; max |a − b| over every position and vocabulary entry",
        "",
        "| model | reference − exact (× std of exact) | cpu − llama.cpp | exact − llama.cpp |",
        "|---|---|---|---|",
    ]
    worst = {"ref": 0.0, "cpu": 0.0, "exact": 0.0}
    for name in names:
        tokens = np.load(ORACLE / f"{name}.tokens.npy")
        exact = np.load(ORACLE / f"{name}.exact.npy")
        llama = np.load(ORACLE / f"{name}.llamacpp.npy")
        ref = Engine(ORACLE / f"{name}.gguf").logits(tokens)
        cpu = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2)).logits(tokens)
        row = {
            "ref": float(np.abs(ref - exact).max() / exact.std()),
            "cpu": float(np.abs(cpu - llama).max()),
            "exact": float(np.abs(exact - llama).max()),
        }
        worst = {k: max(worst[k], v) for k, v in row.items()}
        lines.append(f"| {name} | {row['ref']:.2e} | {row['cpu']:.3f} | {row['exact']:.3f} |")
    lines.append(f"| worst | {worst['ref']:.2e} | {worst['cpu']:.3f} | {worst['exact']:.3f} |")
    report = "\n".join(lines)
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
