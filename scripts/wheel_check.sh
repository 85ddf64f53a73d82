#!/usr/bin/env bash
# The package as a user installs it. From this checkout: build the sdist and, from it, the wheel; check that the
# wheel holds the library only (deepspeed_sdp4bit with its op sources, sdp4bit_cost); install the wheel into a new
# venv (not editable) and, from a folder outside the checkout: import it, build the CPU op by DeepSpeed's op builder
# from the installed sources, run sdp4bit_report and sdp4bit-plan, and train a few ZeRO-3 steps with the block on 2
# CPU ranks (scripts/wheel_smoke.py). Everything it makes is in one temporary folder, removed on exit.
#   SDP4BIT_VENV         the development venv whose python builds the wheel (default <repo>/.venv)
#   SDP4BIT_WHEEL_TORCH  torch requirement of the new venv (default torch==2.13.0: a CPU build, 1.2 GB)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dev_py="${SDP4BIT_VENV:-$root/.venv}/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/sdp4bit-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
began=$SECONDS

"$dev_py" -m build --sdist --wheel --outdir "$work/dist" "$root" > "$work/build.log" 2>&1 ||
  { tail -20 "$work/build.log"; echo "wheel: build FAILED"; exit 1; }
wheel="$(ls "$work"/dist/*.whl)"
echo "wheel: built $(cd "$work/dist" && ls | tr '\n' ' ')"
"$dev_py" - "$wheel" <<'PY'
import collections, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = collections.Counter(name.split("/")[0] for name in names)
library = {"deepspeed_sdp4bit", "sdp4bit_cost"}
strays = sorted(t for t in tops if t not in library and not t.endswith(".dist-info"))
print("wheel: " + ", ".join(f"{top} ({count} files)" for top, count in sorted(tops.items())))
if strays:
    sys.exit(f"wheel: FAILED: it holds more than the library: {strays}")
if not any(name.startswith("deepspeed_sdp4bit/cuda_ext/cpu/") for name in names):
    sys.exit("wheel: FAILED: the CPU op's sources are missing")
PY

python_for_venv="$("$dev_py" -c 'import sys; print(sys.executable)')"
"$python_for_venv" -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q "${SDP4BIT_WHEEL_TORCH:-torch==2.13.0}" > "$work/install.log" 2>&1 &&
  "$py" -m pip install -q "$wheel" >> "$work/install.log" 2>&1 ||
  { tail -20 "$work/install.log"; echo "wheel: install FAILED"; exit 1; }
echo "wheel: installed into a new venv ($("$py" -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"

mkdir "$work/outside"
cp "$root/scripts/wheel_smoke.py" "$work/outside/"
cd "$work/outside"
export PATH="$work/venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$work/extensions"
"$py" - "$root" > "$work/import.log" 2>&1 <<'PY' || { cat "$work/import.log"; echo "wheel: import or op build FAILED"; exit 1; }
import sys
from pathlib import Path
import deepspeed_sdp4bit, sdp4bit_cost
from deepspeed_sdp4bit.ops.builder import CodecCPUBuilder
checkout = Path(sys.argv[1]).resolve()
for module in (deepspeed_sdp4bit, sdp4bit_cost):
    where = Path(module.__file__).resolve()
    if checkout in where.parents:
        sys.exit(f"wheel: FAILED: {module.__name__} imported from the checkout ({where})")
sources = [Path(s) for s in CodecCPUBuilder().sources()]
if not all(s.is_absolute() and checkout not in s.resolve().parents for s in sources):
    sys.exit(f"wheel: FAILED: the op builder's sources are not the installed ones: {sources}")
CodecCPUBuilder().load()
print(f"wheel: imported from {Path(deepspeed_sdp4bit.__file__).parent}; CPU op built by DeepSpeed's op builder "
      f"from {sources[0].parent}")
PY
grep "^wheel:" "$work/import.log"
sdp4bit_report > "$work/report.log" 2>&1 || { cat "$work/report.log"; echo "wheel: sdp4bit_report FAILED"; exit 1; }
grep -E "^(deepspeed-sdp4bit|deepspeed|torch) \.\." "$work/report.log" | sed 's/^/wheel: report: /'
sdp4bit-plan --model 1.3b --nodes 2 --gpus-per-node 8 --inter-node-gbps 100 > "$work/plan.log" 2>&1 ||
  { cat "$work/plan.log"; echo "wheel: sdp4bit-plan FAILED"; exit 1; }
grep -E "^(use |communication hides)" "$work/plan.log" | cut -c1-100 | sed 's/^/wheel: plan: /'
torchrun --nproc-per-node 2 wheel_smoke.py > "$work/smoke.log" 2>&1 ||
  { tail -30 "$work/smoke.log"; echo "wheel: training FAILED"; exit 1; }
grep "wheel smoke:" "$work/smoke.log" | sed 's/^/wheel: /'
echo "wheel: all checks passed in $((SECONDS - began)) s"
