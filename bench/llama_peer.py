"""llama.cpp (llama-cpp-python, the `bench` extra) timed on a GGUF, in a process of its own.

Its own process because llama-cpp-python's ggml and ggml-python's (our cpu backend) are different
builds of one library with the same symbol names: loaded into one process, llama.cpp's calls can land
in the other build's code and crash. The benchmarks call `run` and get what the child printed.

    python bench/llama_peer.py MODEL THREADS N_DECODE [--no-repack] < prompt-token-ids.json
    python bench/llama_peer.py MODEL THREADS N_DECODE --batched < [prompt-token-ids, ...].json
    python bench/llama_peer.py MODEL THREADS ROUNDS --scored FIRST < chunk-token-ids.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def command(path: Path, n_decode: int, threads: int, no_repack: bool = False) -> list[str]:
    """The child's command line (its stdin: the prompt's token ids as JSON)."""
    return [sys.executable, __file__, str(path), str(threads), str(n_decode)] + (["--no-repack"] if no_repack else [])


def run(path: Path, prompt: np.ndarray, n_decode: int, threads: int, cpu: bool = False) -> tuple[float, ...] | str:
    """(prefill tok/s, decode tok/s) of llama.cpp on `path`, or why it did not run; cpu: and the CPU
    milliseconds its process spent per decoded token (every thread's, spinning included)."""
    result = _child(command(path, n_decode, threads), [int(t) for t in prompt])
    if isinstance(result, str):
        return result
    if cpu:
        return result["prefill"], result["decode"], result["decode_cpu_ms"]
    return result["prefill"], result["decode"]


def peer_env() -> dict[str, str]:
    """This process's environment less the OpenMP wait policy fomoepy's cpu backend chose for itself
    (fomoepy.runtime.ggml_threads): llama.cpp runs as its users run it; a policy the user set stays."""
    env = dict(os.environ)
    threads = sys.modules.get("fomoepy.runtime.ggml_threads")
    if threads is not None and threads.SET_HERE:
        env.pop(threads.WAIT_POLICY, None)
    return env


def read_bytes() -> int:
    """Bytes this process has had fetched from storage so far (/proc/self/io)."""
    return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("read_bytes")))


def measure(path: str, prompt: list[int], n_decode: int, threads: int, no_repack: bool = False) -> dict:
    """One batch for the prompt, then one token per call (greedy). no_repack: weights stay in the mapped
    file (llama.cpp's --no-repack), as a model larger than memory needs."""
    import llama_cpp.llama_cpp as api
    from llama_cpp import Llama

    if no_repack:
        defaults = api.llama_model_default_params

        def without_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params = without_repack

    # only the last row's logits, as fomoepy's prefill computes them: logits_all would add the output head's
    # product for every prompt row (about a third of this model's 128-token prefill)
    llm = Llama(path, n_ctx=len(prompt) + n_decode + 8, n_batch=len(prompt), n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)  # fmt: skip

    def last_logits() -> np.ndarray:  # the last decoded batch's one output row (scores is kept only with logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(last_logits()))
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(last_logits()))
    decode_s, decode_cpu_s = time.perf_counter() - t1, time.process_time() - c1
    return {"prefill": len(prompt) / prefill_s, "decode": n_decode / decode_s, "read_bytes": read_bytes(),
            "decode_cpu_ms": decode_cpu_s / n_decode * 1e3}  # fmt: skip


def run_batched(path: Path, prompts: list[np.ndarray], n_decode: int, threads: int) -> dict | str:
    """llama.cpp decoding len(prompts) sequences together (one llama_decode a step, a token of each), in
    a child: {"decode": aggregate tok/s, "tokens": each sequence's greedy tokens}, or why it did not run."""
    return _child([sys.executable, __file__, str(path), str(threads), str(n_decode), "--batched"],
                  [[int(t) for t in p] for p in prompts])  # fmt: skip


def _child(cmd: list[str], stdin) -> dict | str:
    """What the child printed last (JSON), stdin sent to it as JSON; or, where it failed, why, in a line."""
    child = subprocess.run(cmd, input=json.dumps(stdin), capture_output=True, text=True, check=False, env=peer_env())
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return f"not run ({last})"
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure_batched(path: str, prompts: list[list[int]], n_decode: int, threads: int) -> dict:
    """Each prompt prefilled as its own sequence, then n_decode steps that each decode one token of every
    sequence in one batch (greedy), as llama.cpp's server batches its slots; only the steps are timed."""
    import ctypes

    import llama_cpp.llama_cpp as api

    api.llama_backend_init()
    model = api.llama_model_load_from_file(path.encode(), api.llama_model_default_params())
    n_seq, longest = len(prompts), max(len(p) for p in prompts)
    params = api.llama_context_default_params()
    params.n_ctx = n_seq * (longest + n_decode + 8)  # each sequence's share is n_ctx / n_seq_max
    params.n_batch = params.n_ubatch = max(longest, n_seq)
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    ctx = api.llama_init_from_model(model, params)
    n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(model))
    batch = api.llama_batch_init(max(longest, n_seq), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        if api.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    def argmax_of(row: int) -> int:
        scores = api.llama_get_logits_ith(ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(scores, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))))

    nxt, out = [], [[] for _ in prompts]
    for s, prompt in enumerate(prompts):
        decode([(t, i, s, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        nxt.append(argmax_of(len(prompt) - 1))
    t0 = time.perf_counter()
    for step in range(n_decode):
        decode([(nxt[s], len(prompts[s]) + step, s, True) for s in range(n_seq)])
        for s in range(n_seq):
            out[s].append(nxt[s])
            nxt[s] = argmax_of(s)
    seconds = time.perf_counter() - t0
    api.llama_batch_free(batch)
    api.llama_free(ctx)
    api.llama_model_free(model)
    return {"decode": n_seq * n_decode / seconds, "tokens": out}


def run_scored(path: Path, chunk: np.ndarray, first: int, threads: int, rounds: int = 2) -> float | str:
    """llama.cpp's tok/s over a perplexity chunk evaluated as one batch with the output head on the rows
    from `first` on (the rows a perplexity scores), in a child; or why it did not run."""
    cmd = [sys.executable, __file__, str(path), str(threads), str(rounds), "--scored", str(first)]
    result = _child(cmd, [int(t) for t in chunk])
    return result if isinstance(result, str) else result["scored"]


def measure_scored(path: str, chunk: list[int], first: int, threads: int, rounds: int) -> dict:
    """The chunk as one llama_decode from an empty cache, logits for rows first.. only: what
    llama-perplexity's batch computes (it asks for every row's; the rows before `first` it never
    scores), timed over `rounds` passes after an untimed one (the weights paged in, the threads up)."""
    import llama_cpp.llama_cpp as api

    api.llama_backend_init()
    model = api.llama_model_load_from_file(path.encode(), api.llama_model_default_params())
    params = api.llama_context_default_params()
    params.n_ctx = len(chunk) + 8
    params.n_batch = params.n_ubatch = len(chunk)
    params.n_threads = params.n_threads_batch = threads
    ctx = api.llama_init_from_model(model, params)
    batch = api.llama_batch_init(len(chunk), 0, 1)
    batch.n_tokens = len(chunk)
    for i, t in enumerate(chunk):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, i >= first
        batch.seq_id[i][0] = 0
    seconds = 0.0
    for r in range(rounds + 1):
        api.llama_memory_clear(api.llama_get_memory(ctx), True)  # every pass from an empty cache, as a chunk is
        t0 = time.perf_counter()
        if api.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        if r:
            seconds += time.perf_counter() - t0
    api.llama_batch_free(batch)
    api.llama_free(ctx)
    api.llama_model_free(model)
    return {"scored": rounds * len(chunk) / seconds}


if __name__ == "__main__":
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        sys.exit(f"{e}; pip install -e '.[bench]'")
    model, n_threads, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if "--scored" in sys.argv[4:]:
        first = int(sys.argv[sys.argv.index("--scored") + 1])
        print(json.dumps(measure_scored(model, json.load(sys.stdin), first, n_threads, decode)))
    elif "--batched" in sys.argv[4:]:
        print(json.dumps(measure_batched(model, json.load(sys.stdin), decode, n_threads)))
    else:
        print(json.dumps(measure(model, json.load(sys.stdin), decode, n_threads, "--no-repack" in sys.argv[4:])))
