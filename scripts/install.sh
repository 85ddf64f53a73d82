#!/usr/bin/env bash
# Create the project's virtual environment (.venv in the repository) if absent and install the project with its
# example and test extras into it, and the repository's test harness, benchmarks and examples (the development
# project in dev/), both editable. Idempotent: when everything is installed and neither pyproject.toml has changed
# since, it returns in a second.
#   PYTHON          interpreter for a new venv (default python3, >= 3.10)
#   SDP4BIT_VENV    venv location (default <repo>/.venv)
#   SDP4BIT_TORCH   torch requirement installed when the venv has no torch (default torch==2.14.1: on CPU-only
#                   machines of this project's kind it is a CUDA 13.0 build that runs on the CPU and lets the CUDA
#                   op be compile-checked; set e.g. "torch" to take what pip picks for your machine)
#   SDP4BIT_DEEPSPEED  a DeepSpeed version inside the supported range (pyproject.toml) to install instead of the
#                   newest one pip picks, e.g. 0.17.6; the venv's DeepSpeed is replaced when it differs
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SDP4BIT_VENV:-$root/.venv}"
py="$venv/bin/python"
stamp="$venv/.sdp4bit-installed"

if [ ! -x "$py" ]; then
  echo "install: creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi

have_all() {
  "$py" - <<'PY'
import importlib.util, sys
mods = ["torch", "deepspeed", "deepspeed_sdp4bit", "sdp4bit_cost", "scipy", "transformers", "accelerate", "datasets",
        "tokenizers", "matplotlib", "pytest", "pytest_timeout", "hypothesis", "ninja", "sdp4bit_testing",
        "sdp4bit_benchmarks", "sdp4bit_examples", "ruff", "mypy"]
sys.exit(any(importlib.util.find_spec(m) is None for m in mods))
PY
}

deepspeed_is_asked() {
  [ -z "${SDP4BIT_DEEPSPEED:-}" ] || [ "$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null)" = "$SDP4BIT_DEEPSPEED" ]
}

if [ -f "$stamp" ] && [ "$stamp" -nt "$root/pyproject.toml" ] && [ "$stamp" -nt "$root/dev/pyproject.toml" ] &&
    have_all && deepspeed_is_asked; then
  echo "install: $venv is up to date"
  exit 0
fi
if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  echo "install: ${SDP4BIT_TORCH:-torch==2.14.1} (a minute or two)"
  "$py" -m pip install -q "${SDP4BIT_TORCH:-torch==2.14.1}"
fi
if [ -n "${SDP4BIT_DEEPSPEED:-}" ]; then
  echo "install: deepspeed==$SDP4BIT_DEEPSPEED"
  "$py" -m pip install -q "deepspeed==$SDP4BIT_DEEPSPEED"
fi
echo "install: the project and its [test] extras (editable)"
"$py" -m pip install -q -e "$root[test]"
echo "install: the test harness, benchmarks and examples (dev/, editable)"
"$py" -m pip install -q --no-deps -e "$root/dev"
touch "$stamp"
echo "install: done ($("$py" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1))"
