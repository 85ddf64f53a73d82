#!/usr/bin/env bash
# The README's second command: install what is needed, then run the linter, the formatter check, the type checker
# and the whole test suite, and print their summaries (any failure fails the command).
# Compiled ops are JIT-built into TORCH_EXTENSIONS_DIR: a fresh temporary folder (removed afterwards) unless one
# is set, so a run proves the ops build from scratch. TORCH_CUDA_ARCH_LIST defaults to 9.0 (H100/H200) for the
# CUDA compile check. Extra arguments go to pytest (e.g. bash scripts/test.sh -k configs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/install.sh
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
  TORCH_EXTENSIONS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/sdp4bit-torch-extensions.XXXXXX")"
  trap 'wait; rm -rf "$TORCH_EXTENSIONS_DIR"' EXIT
fi
export TORCH_EXTENSIONS_DIR
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export TOKENIZERS_PARALLELISM=false
# Hypothesis: the derandomized "ci" profile (the same examples every run) unless told otherwise (tests/conftest.py)
export SDP4BIT_HYPOTHESIS_PROFILE="${SDP4BIT_HYPOTHESIS_PROFILE:-ci}"
# Under CI a missing CUDA toolkit or g++ fails the tests that need it instead of skipping them (sdp4bit_testing/toolkit.py)
if [ -n "${CI:-}" ]; then
  export SDP4BIT_REQUIRE_TOOLKIT="${SDP4BIT_REQUIRE_TOOLKIT:-1}"
fi
# the venv's tools first, as an activated venv has them: every JIT build (DeepSpeed's own ops too) then uses the
# venv's ninja, whose build logs another ninja version would discard (a rebuild of every cached op)
venv_bin="${SDP4BIT_VENV:-$root/.venv}/bin"
export PATH="$venv_bin:$PATH"
echo "test: TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
  "SDP4BIT_REQUIRE_TOOLKIT=${SDP4BIT_REQUIRE_TOOLKIT:-0} SDP4BIT_HYPOTHESIS_PROFILE=$SDP4BIT_HYPOTHESIS_PROFILE"
# the JIT ops' compiles run beside the first (single-process) tests; slow tests run last (tests/conftest.py)
prebuild_log="$(mktemp "${TMPDIR:-/tmp}/sdp4bit-prebuild.XXXXXX")"
"$venv_bin/python" -m sdp4bit_testing.prebuild > "$prebuild_log" 2>&1 &
prebuild=$!
status=0
# the maintainers' checks (configured in pyproject.toml): lint, format, and the whole library's types (strict)
echo "test: ruff check, ruff format --check, mypy"
"$venv_bin/ruff" check --quiet . || status=$?
"$venv_bin/ruff" format --check --quiet . || status=$?
"$venv_bin/mypy" || status=$?
"$venv_bin/python" -m pytest -q -rfEs --durations=20 tests "$@" || status=$?
wait "$prebuild" || true
grep "^prebuild:" "$prebuild_log" || cat "$prebuild_log"
rm -f "$prebuild_log"
exit "$status"
