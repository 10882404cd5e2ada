"""llama.cpp (llama-cpp-python, the `bench` extra) timed on a GGUF, in a process of its own.

Its own process because llama-cpp-python's ggml and ggml-python's (our cpu backend) are different
builds of one library with the same symbol names: loaded into one process, llama.cpp's calls can land
in the other build's code and crash. The benchmarks call `run` and get what the child printed.

    python bench/llama_peer.py MODEL THREADS N_DECODE < prompt-token-ids.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def run(path: Path, prompt: np.ndarray, n_decode: int, threads: int) -> tuple[float, float] | str:
    """(prefill tok/s, decode tok/s) of llama.cpp on `path`, or why it did not run."""
    child = subprocess.run(
        [sys.executable, __file__, str(path), str(threads), str(n_decode)],
        input=json.dumps([int(t) for t in prompt]), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return f"not run ({last})"
    result = json.loads(child.stdout.strip().splitlines()[-1])
    return result["prefill"], result["decode"]


def measure(path: str, prompt: list[int], n_decode: int, threads: int) -> dict:
    """One batch for the prompt, then one token per call (greedy)."""
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=len(prompt) + n_decode + 8, n_batch=len(prompt), n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)  # fmt: skip  (scores holds every row)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t1 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return {"prefill": len(prompt) / prefill_s, "decode": n_decode / (time.perf_counter() - t1)}


if __name__ == "__main__":
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        sys.exit(f"{e}; pip install -e '.[bench]'")
    model, n_threads, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(measure(model, json.load(sys.stdin), decode, n_threads)))
