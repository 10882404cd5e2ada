"""Memory that the user's numbers bound: `fomoe generate --backend cpu` with a store keeps its peak
resident set within dense weights + --ram-cache + KV cache + an overhead counted term by term (the
libraries as measured, record buffers and work areas as specified below), on a model about twice that
size (the reference backend's float32 copies of each fetched expert would not fit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fomoepy.experts.source import expert_index
from fomoepy.experts.store_format import ALIGN, align_up
from fomoepy.experts.store_reader import MAX_THREADS
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
RAM_CACHE = 8 << 20
# The overhead beyond dense weights, --ram-cache and KV cache, term by term:
# - the interpreter and its libraries (numpy, gguf, tokenizers, ggml, ...): measured here, as the peak
#   resident set of a fresh interpreter that imports every module the run imported, so it is this
#   machine's and this environment's figure, not one machine's constant;
# - expert record buffers, each a store slot plus its alignment (from the file's expert sizes):
#   RECORDS_PER_READER per store reader thread (one being read, one read and waiting for its step, one
#   freed and kept by that thread's malloc arena) and one per expert of a step. A specification: on this
#   model and on one with records 4x as large, what the run held beyond libraries and WORK_AREAS fitted
#   25 records;
# - WORK_AREAS: ggml's graph contexts and work buffers, the tokenizer, the GGUF index, thread stacks and
#   numpy temporaries. A specification: 5-11 MB measured on those two models (-t 1 and 2, 0-32 tokens),
#   stated with room for allocators that keep more.
RECORDS_PER_READER = 3
WORK_AREAS = 32 << 20
PEAK_OF = (
    "import json, sys; from fomoepy.cli import main; code = main(sys.argv[1:]); "
    "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1], file=sys.stderr); "
    "print(json.dumps(sorted(sys.modules)), file=sys.stderr); sys.exit(code)"
)
IMPORTS_OF = (
    "import importlib, json, sys\n"
    "for name in json.loads(sys.stdin.read()):\n"
    "    try:\n"
    "        importlib.import_module(name)\n"
    "    except Exception:\n"
    "        pass  # a module only its parent's import can make (or one of __main__'s): counted with it\n"
    "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    path = d / "m.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    shape = "--arch qwen3moe --n-vocab 512 --n-embd 512 --n-layer 8 --n-head 4 --n-head-kv 2 --head-dim 64"
    shape += " --n-expert 48 --n-expert-used 4 --expert-ff 512 --context-length 256 --expert-types Q8_0 --dense-type Q8_0"
    subprocess.run([sys.executable, str(ROOT / "tools/make_test_model.py"), str(path), *shape.split()], check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "fomoepy.cli", "prepare", str(path), str(d / "store")], check=True, env=env, capture_output=True)
    return path, d / "store", env


def peak_rss(path, env, *extra) -> tuple[int, list[str]]:
    """(the peak resident set of `fomoe generate`, the modules it imported)."""
    cmd = [sys.executable, "-c", PEAK_OF, "generate", str(path), "-p", "a b c", "-n", "8",
           "--ram-cache", str(RAM_CACHE), "-t", "1", *extra]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    *_, peak, modules = r.stderr.strip().splitlines()
    return int(peak) * 1024, json.loads(modules)


def libraries(env, modules: list[str]) -> int:
    """The peak resident set of a fresh interpreter that imports `modules`."""
    names = [m for m in modules if m != "__main__"]
    r = subprocess.run([sys.executable, "-c", IMPORTS_OF], input=json.dumps(names), capture_output=True, text=True,
                       env=env, timeout=300, check=True)  # fmt: skip
    return int(r.stdout) * 1024


def memory_bound(path, libraries_bytes: int) -> int:
    """dense weights + --ram-cache + KV cache + the overhead above, from the file's own sizes."""
    gf = GGUFFile(path)
    spec = ModelSpec.from_gguf(gf)
    layers = expert_index(gf, spec)
    experts = sum(layer.expert_nbytes for layer in layers) * spec.moe.n_expert
    dense = path.stat().st_size - experts
    a = spec.attention
    kv = 2 * spec.context_length * a.n_head_kv * a.head_dim * 4 * spec.n_layer
    record = align_up(max(layer.expert_nbytes for layer in layers)) + ALIGN  # aligned_empty's buffer
    records = (RECORDS_PER_READER * MAX_THREADS + spec.moe.n_expert_used) * record
    bound = dense + RAM_CACHE + kv + libraries_bytes + records + WORK_AREAS
    assert bound < 0.5 * path.stat().st_size  # the point: a model twice the memory it is given
    return bound


def within_bound(path, env, *extra) -> None:
    peak, modules = peak_rss(path, env, *extra)
    lib = libraries(env, modules)
    bound = memory_bound(path, lib)
    print(f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB (libraries {lib / 2**20:.1f} MiB)")
    assert peak <= bound, (peak, bound, lib)


def test_cpu_backend_peak_memory_is_dense_plus_ram_cache_plus_kv_plus_overhead(big_model):
    path, store, env = big_model
    within_bound(path, env, "--store", str(store))


def test_without_a_store_the_mapped_gguf_pages_do_not_pile_up(big_model):
    """Experts computed from the mapped GGUF: what each use faulted in is unmapped after it (the page
    cache keeps it), so the same bound holds; without that the whole file ends up resident."""
    path, _, env = big_model
    within_bound(path, env)
