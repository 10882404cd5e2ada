#!/usr/bin/env bash
# Make the kernel compilers available on a machine without a GPU, for the compile checks
# (tests/test_kernels_compile.py, tests/test_kernels_amdgpu.py) and for CI (.ci/run):
#   NVRTC  - cuda-python + the nvidia-cuda-nvrtc wheel (the `cuda` extra of pyproject.toml), via pip
#   clang  - Debian's clang-19, ROCm 5.2 HIP headers and device libraries (apt-get install, as root): the
#            AMDGPU back end that knows RDNA4 (gfx1200/gfx1201), for code generation and resource checks;
#            the device libraries (ocml/ockl bitcode) are linked into that code as hiprtc links them
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

# --- clang for AMDGPU code generation -------------------------------------------------------------------
# Debian 12's ROCm 5.2 hiprtc aborts for gfx11/gfx12; its clang-19 compiles them. Not fatal: the
# code generation tests skip, saying why, where this cannot be installed.
AMDGPU_PACKAGES="clang-19 libamdhip64-dev rocm-device-libs"
if ! command -v clang-19 >/dev/null || [ ! -f /usr/include/hip/hip_runtime.h ] \
    || ! dpkg-query -W -f '${Status}' rocm-device-libs 2>/dev/null | grep -q "install ok installed"; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        install_clang() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $AMDGPU_PACKAGES; }
        install_clang >/tmp/fomoepy-clang.log 2>&1 || { apt-get update >/dev/null 2>&1; install_clang >/tmp/fomoepy-clang.log 2>&1; } \
            || echo "amdgpu clang: apt-get install $AMDGPU_PACKAGES failed (see /tmp/fomoepy-clang.log)" >&2
    else
        echo "amdgpu clang: unavailable (needs root and apt-get: apt-get install $AMDGPU_PACKAGES)" >&2
    fi
fi
if command -v clang-19 >/dev/null; then echo "amdgpu-clang: $(command -v clang-19)"; fi
if devlibs="$(dpkg-query -L rocm-device-libs 2>/dev/null | grep '/ocml\.bc$')"; then echo "amdgpu-device-libs: $(dirname "$devlibs")"; fi

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
