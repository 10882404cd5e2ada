#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU, in one run: the kernels and the whole model against the CPU
# (the `gpu`-marked tests), compute-sanitizer's race, sync and memory checks over the ops, the expert
# kernels' bandwidth, and a decode with the per-layer timing split. Logs go to DIR; RESULTS.md gets the
# bandwidth table from bench/gpu_kernels.py --record and host_time.py --real-gpu --record, and DIR a copy of it.
#
#     bash bench/gpu_checks.sh DIR
set -uo pipefail
out=${1:?usage: bash bench/gpu_checks.sh DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FOMOEPY_TEST_GPU=cuda PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo; echo "=== $1 ($(date +%T))"; }

step "device and bindings"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
grep -m1 "model name" /proc/cpuinfo; nproc
python3 - <<'EOF'
import importlib.metadata as m
for p in ("cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc", "numpy", "gguf"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "absent")
EOF

step "gpu-marked tests: every op and the oracle models against the CPU backend"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_ops.py tests/test_gpu_model.py 2>&1 | tee "$out/pytest_gpu.log" | tail -25

sanitize() {  # tool, seconds: compute-sanitizer over the reductions, the router and the products
    step "compute-sanitizer --tool $1"
    timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_ops.py \
        -k "rms_norm or softmax or router or argmax or attention or linear_equals" 2>&1 \
        | tee "$out/sanitizer_$1.log" | tail -12
    echo "exit: ${PIPESTATUS[0]}"
}

step "host time per MoE layer step through the real driver, 397B shape (wall time: includes device waits)"
timeout 110 python3 bench/host_time.py --real-gpu --vendor cuda --tokens 16 --warm 16 --record 2>&1 | tee "$out/host_time_real.log" | tail -12

step "expert and dense kernel bandwidth"
timeout 60 python3 bench/gpu_kernels.py --vendor cuda --reps 50 --record 2>&1 | tee "$out/gpu_kernels.log" | tail -15

step "decode on the device, demo model, per-layer timing split"
timeout 40 python3 -m fomoepy.cli generate -p "import os" -n 64 --backend cuda --seed 0 --temp 0 --profile-timing 2>&1 | tee "$out/generate_cuda.log" | tail -14

step "the MoE step with an expert store: reads land in pinned memory, copied up with no staging; same text"
timeout 75 python3 - <<'EOF' 2>&1 | tee "$out/store_step.log" | tail -6
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
EOF


command -v compute-sanitizer >/dev/null && sanitize racecheck 75 || echo "compute-sanitizer: not on this machine"
command -v compute-sanitizer >/dev/null && sanitize memcheck 50
cp bench/RESULTS.md "$out/RESULTS.md"
step "done"
