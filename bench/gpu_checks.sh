#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU, in one run, the most wanted first: the compiled parts built for
# this Python; the host time per MoE layer step through the real driver at the 397B shape, with the null
# stand-in beside it on the same host; the compiled decode step's scripts over the real driver (its C and
# its Python definition make the same driver calls and the same bits); the kernels and the whole model
# against the CPU (the `gpu`-marked tests); a store-backed decode; a decode with the per-layer timing
# split; with --sanitize, compute-sanitizer's race and memory checks over the ops. Logs go to DIR;
# RESULTS.md gets host_time.py --real-gpu --record's table, and DIR a copy of it.
#
#     bash bench/gpu_checks.sh DIR [--sanitize]
set -uo pipefail
out=${1:?usage: bash bench/gpu_checks.sh DIR [--sanitize]}
sanitize_too=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FOMOEPY_TEST_GPU=cuda PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo; echo "=== $1 ($(date +%T))"; }

step "device and bindings"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
grep -m1 "model name" /proc/cpuinfo; nproc
python3 - <<'PY'
import importlib.metadata as m
import sys
print("python", sys.version.split()[0])
for p in ("cuda-bindings", "cuda-python", "cuda-pathfinder", "nvidia-cuda-nvrtc", "numpy", "gguf", "crc32c"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "absent")
PY

step "the compiled parts, built for this Python (setup.py); a missing one leaves its Python definition serving"
timeout 90 python3 setup.py -q build_ext --inplace -j 8 >"$out/build_ext.log" 2>&1; echo "exit: $?"
python3 - <<'PY'
import importlib
for m in ("fomoepy.experts._cache_core", "fomoepy.runtime._driver_calls", "fomoepy.runtime._moe_tables",
          "fomoepy.runtime._host_memory", "fomoepy.experts._reads", "fomoepy.experts._acquire"):
    try:
        importlib.import_module(m)
        print(m, "built")
    except ImportError as e:
        print(m, "MISSING:", e)
PY

step "host time per MoE layer step through the real driver, 397B shape (wall time: includes device waits); the null stand-in beside it"
timeout 170 python3 bench/host_time.py --real-gpu --vendor cuda --tokens 32 --warm 96 --record 2>&1 | tee "$out/host_time_real.log" | tail -3 | cut -c1-2500
cp bench/RESULTS.md "$out/RESULTS.md"

step "the compiled decode step over the real driver: the driver calls and bits of its Python definition"
FOMOEPY_TEST_REAL_DRIVER=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_launch.py \
    tests/test_decode_experts.py tests/test_direct_calls.py \
    -k "cuda and (each_direct_call or launched_in_c or device_work_in_c or c_function_changed)" \
    2>&1 | tee "$out/pytest_real_driver.log" | tail -15

step "gpu-marked tests: every op and the oracle models against the CPU backend"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_ops.py tests/test_gpu_model.py 2>&1 | tee "$out/pytest_gpu.log" | tail -25

step "the MoE step with an expert store: reads land in pinned memory, copied up with no staging; same text"
timeout 75 python3 - <<'PY' 2>&1 | tee "$out/store_step.log" | tail -6
from fomoepy.data import demo_model_path, ensure_demo_store
from fomoepy.engine import Engine, EngineOptions
model = demo_model_path()
store = (str(ensure_demo_store(model)),)
prompt, texts = [1, 2, 3, 4], {}
for backend in ("cuda", "reference"):
    # tiers far smaller than the experts: every step misses, demotes and copies up
    e = Engine(model, EngineOptions(backend=backend, store=store, vram_cache=600_000, ram_cache=1_200_000))
    texts[backend] = list(e.generate(prompt, 48))
    if backend == "cuda":
        d = e.experts.device
        print(f"uploads {d.uploads}, of which direct from pinned reads {d.direct_uploads}; downloads {d.downloads}")
    print(backend, e.stats_lines()[0])
    e.close()
print("greedy tokens equal:", texts["cuda"] == texts["reference"])
PY

step "decode on the device, demo model, per-layer timing split"
timeout 40 python3 -m fomoepy.cli generate -p "import os" -n 64 --backend cuda --seed 0 --temp 0 --profile-timing 2>&1 | tee "$out/generate_cuda.log" | tail -14

sanitize() {  # tool, seconds: compute-sanitizer over the reductions, the router and the products
    step "compute-sanitizer --tool $1"
    timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_ops.py \
        -k "rms_norm or softmax or router or argmax or attention or linear_equals" 2>&1 \
        | tee "$out/sanitizer_$1.log" | tail -12
    echo "exit: ${PIPESTATUS[0]}"
}
if [ "$sanitize_too" = --sanitize ]; then
    if command -v compute-sanitizer >/dev/null; then
        sanitize racecheck 75
        sanitize memcheck 50
    else
        echo "compute-sanitizer: not on this machine"
    fi
fi
step "done"
