#!/usr/bin/env bash
# Make both run-time kernel compilers available on a machine without a GPU, for the compile checks
# (tests/test_kernels_compile.py) and for CI (.ci/run):
#   NVRTC  - cuda-python + the nvidia-cuda-nvrtc wheel (the `cuda` extra of pyproject.toml), via pip
#   hiprtc - Debian's ROCm runtime packages, downloaded with apt-get and unpacked (dpkg-deb -x) into
#            a cache directory: nothing is installed system-wide; tests load it with ctypes
# Idempotent and cached: a second run does nothing. Prints "hiprtc: <dir>" with the libraries' path.
#
#   FOMOEPY_COMPILERS   cache directory (default: ${XDG_CACHE_HOME:-~/.cache}/fomoepy-compilers)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${FOMOEPY_COMPILERS:-${XDG_CACHE_HOME:-$HOME/.cache}/fomoepy-compilers}"
PYTHON="${PYTHON:-python3}"
# hiprtc lives in libamdhip64 on ROCm 5.2 (Debian 12); comgr compiles through LLVM 15 and links the
# device libraries (ocml/ockl bitcode) from rocm-device-libs
ROCM_PACKAGES="libamdhip64-5 libhiprtc-builtins5 libamd-comgr2 libhsa-runtime64-1 libhsakmt1 libllvm15 rocm-device-libs"

# --- NVRTC ---------------------------------------------------------------------------------------------
if ! "$PYTHON" -c "from cuda.bindings import nvrtc; nvrtc.nvrtcVersion()" >/dev/null 2>&1; then
    mapfile -t CUDA_PINS < <("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["cuda"]))
PY
)
    echo "installing NVRTC: ${CUDA_PINS[*]}" >&2
    "$PYTHON" -m pip install --quiet --disable-pip-version-check "${CUDA_PINS[@]}"
fi
"$PYTHON" -c "from cuda.bindings import nvrtc; print('nvrtc: %d.%d' % nvrtc.nvrtcVersion()[1:])"

# --- hiprtc --------------------------------------------------------------------------------------------
HIP_DIR="$CACHE/hiprtc"
LIB_DIR="$HIP_DIR/usr/lib/x86_64-linux-gnu"
if [ ! -f "$HIP_DIR/.complete" ]; then
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        echo "hiprtc: unavailable (needs apt-get and dpkg-deb: a Debian/Ubuntu machine)" >&2
        exit 3
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # apt's sandbox user cannot write into a private mktemp directory; download as the caller
    download() { (cd "$work" && apt-get -o APT::Sandbox::User=root download $ROCM_PACKAGES); }
    if ! download >"$work/apt.log" 2>&1; then
        apt-get update >"$work/update.log" 2>&1 || true
        download >"$work/apt.log" 2>&1 || { cat "$work/apt.log" >&2; echo "hiprtc: apt-get download failed" >&2; exit 3; }
    fi
    mkdir -p "$work/root"
    for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
    ls "$work"/*.deb | xargs -n1 basename >"$work/root/.complete"
    mkdir -p "$CACHE"
    rm -rf "$HIP_DIR"
    mv "$work/root" "$HIP_DIR"
fi
echo "hiprtc: $LIB_DIR"
