#!/usr/bin/env bash
# Rebuilds the installed ggml-python (its Python bindings, 0.0.45) over the ggml that llama.cpp ships,
# in place of the ggml that ggml-python's sdist carries. Run after `pip install -e .`; idempotent.
#
# Why: ggml-python 0.0.45 carries ggml 0.15.3, which computes a prompt's several-row products of plain
# (not repacked) quantised weights as a dot product per row and column; llama.cpp's ggml (0.25.3, the
# one llama-cpp-python 0.3.36 vendors, which bench/cpu_decode.py's peer runs) computes them with GEMM
# kernels. On the bench model a 128-token prefill is about a sixth faster (bench/ggml_builds.py,
# bench/cpu_decode.py); decode is unchanged. Every function and struct fomoepy reaches through the
# bindings has the same C interface in both (tests/test_ggml_abi.py checks the ones that changed
# elsewhere in the header do not matter here). llamafile's kernels are on, as in llama.cpp's own build:
# its GEMMs take a prompt's products of F32, F16, BF16, Q8_0 and Q4_0 weights (the dense Q8_0 ones of a
# Q8_0/K-quant model), about a sixth of a 128-token prefill on the bench model (bench/cpu_decode.py).
# They sum a several-row product in another order than a row alone, so a batched decode step multiplies
# each sequence's row apart (fomoepy.runtime.ggml_dense.product, ggml_matmul.rows_apart) and keeps its
# lone run's bits (tests/test_batch.py).
#
# Offline or on failure it keeps ggml-python's own build and says so in one line (exit 0), except
# under CI=true, where the tests must run on the ggml the benchmarks were recorded with.
set -euo pipefail

GGML_PYTHON=0.0.45
LLAMA_CPP_PYTHON=0.3.36
GGML=0.25.3
PY=${PYTHON:-python3}

installed() {
    "$PY" - <<'EOF'
import ctypes, os
import ggml
d = os.path.join(os.path.dirname(ggml.__file__), "lib")
lib = ctypes.CDLL(os.path.join(d, "libggml-base.so"))
lib.ggml_version.restype = ctypes.c_char_p
cpu = ctypes.CDLL(os.path.join(d, "libggml-cpu.so"))
print(lib.ggml_version().decode() + ("+llamafile" if getattr(cpu, "ggml_cpu_has_llamafile", lambda: 0)() else ""))
EOF
}

if [ "$(installed 2>/dev/null || true)" = "$GGML+llamafile" ]; then
    echo "ggml: $GGML (llamafile on) already under ggml-python's bindings"
    exit 0
fi

fail() {
    if [ "${CI:-}" = true ]; then
        echo "ggml: $1 (under CI the build must succeed)" >&2
        exit 1
    fi
    echo "ggml: kept ggml-python's own ggml ($(installed 2>/dev/null || echo '?')): $1" >&2
    exit 0
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$work/build.log"
start=$(date +%s)
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$work" \
    "ggml-python==$GGML_PYTHON" "llama-cpp-python==$LLAMA_CPP_PYTHON" >"$log" 2>&1 \
    || fail "could not download the sdists ($(tail -n 1 "$log"))"
tar -xzf "$work/ggml_python-$GGML_PYTHON.tar.gz" -C "$work" || fail "bad ggml-python sdist"
tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$work" \
    "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/ggml" || fail "bad llama-cpp-python sdist"
src="$work/ggml_python-$GGML_PYTHON"
rm -rf "$src/vendor/ggml"
mv "$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/ggml" "$src/vendor/ggml"
grep -q "GGML_VERSION_MINOR $(echo "$GGML" | cut -d. -f2))" "$src/vendor/ggml/CMakeLists.txt" \
    || fail "llama-cpp-python $LLAMA_CPP_PYTHON does not carry ggml $GGML"
CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_LLAMAFILE=ON" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/wheel" "$src" >>"$log" 2>&1 \
    || fail "the build failed ($(tail -n 1 "$log"))"
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$work"/wheel/*.whl >>"$log" 2>&1 \
    || fail "could not install the build ($(tail -n 1 "$log"))"
[ "$(installed)" = "$GGML+llamafile" ] || fail "the installed library is not ggml $GGML with llamafile ($(installed))"
echo "ggml: $GGML (llamafile on) under ggml-python $GGML_PYTHON's bindings, built in $(( $(date +%s) - start )) s"
