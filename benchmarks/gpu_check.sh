#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA GPU (docs/gpu_check.md says how to run and read it).
#
# Installs what is missing of deepspeed, hjson, pydantic, pytest and ninja (with pip, or offline from a wheel folder
# given as GPU_CHECK_WHEELS), JIT-builds our CUDA codec op and DeepSpeed's ZeRO++ quantizer op in parallel, runs the
# GPU tests (the codec's bit-exactness and smoke tests first, the rest after the benchmarks), runs the kernel
# benchmarks (benchmarks/kernels.py --device cuda with ZeRO++'s rows plugged in, and the head-to-head of
# benchmarks/kernels_zeropp.py: ZeRO++'s kernels beside ours on the same sizes, with the H200 speed targets), writes
# every log under $OUT and prints a short summary last. Each step has a time limit inside an overall budget
# (GPU_CHECK_BUDGET_S, default 1800 s), so the summary always comes out.
#   PYTHON              interpreter with a CUDA build of torch (default python3)
#   OUT                 log folder (default runs/gpu_check)
#   GPU_CHECK_WHEELS    optional folder of wheels to install from without network (pip --no-index --find-links)
#   TORCH_CUDA_ARCH_LIST, MAX_JOBS   architectures and parallel compiles of the op builds (default: the visible
#                       GPUs' architectures, all cores)
#   TORCH_EXTENSIONS_DIR  where the ops are built and loaded from (default: .torch_extensions in this checkout); it
#                       must belong to you and be writable by no one else, since the tests import the .so files in it
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
(umask 077 && mkdir -p "$TORCH_EXTENSIONS_DIR")
if [[ ! -O "$TORCH_EXTENSIONS_DIR" ]] || [[ -n "$(find "$TORCH_EXTENSIONS_DIR" -maxdepth 0 -perm /022)" ]]; then
  echo "gpu_check: TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR must be a folder you own that no one else can write" \
       "to (the ops' .so files are imported from it); use another folder or chmod go-w it" >&2
  exit 2
fi
PY=${PYTHON:-python3}
BEGIN=$(date +%s)
DEADLINE=$((BEGIN + ${GPU_CHECK_BUDGET_S:-1800}))
: > "$OUT/steps.tsv"

# step NAME LIMIT_S LOG CMD...: run CMD with its output in $OUT/LOG, at most LIMIT_S and never past the deadline
# (15 s kept for the summary); record name, exit status and seconds in steps.tsv.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((DEADLINE - $(date +%s) - 15))
  ((left < limit)) && limit=$left
  if ((limit <= 0)); then
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    return
  fi
  local start rc
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*" >> "$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" >> "$OUT/steps.tsv"
  echo "$name: exit $rc after $(($(date +%s) - start)) s"
}

# build_ops: the two op builds in parallel, one line per build; the script is read from stdin (no temporary file).
build_ops() {
  "$PY" - <<'EOF'
import concurrent.futures, subprocess, sys, time

CODE = {
    "sdp4bit_codec_cuda": "from deepspeed_sdp4bit.ops import CodecCUDABuilder as B; B().load(verbose=True)",
    "deepspeed quantizer": "from deepspeed.ops.op_builder import QuantizerBuilder as B; B().load(verbose=True)",
}

def build(name):
    start = time.time()
    done = subprocess.run([sys.executable, "-c", CODE[name]], capture_output=True, text=True)
    return name, done.returncode, time.time() - start, done.stdout + done.stderr

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(build, CODE))
for name, rc, seconds, log in results:
    print(f"--- {name}: exit {rc}, {seconds:.1f} s\n{log[-6000:]}")
for name, rc, seconds, _ in results:
    print(f"BUILD {name}: exit {rc}, {seconds:.1f} s")
sys.exit(max(rc for _, rc, _, _ in results))
EOF
}
export -f build_ops

PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout=180)
CODEC_TESTS=(tests/test_codec_backends.py tests/test_op_builder_cuda.py)

step env 30 setup.log bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; \
  $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
  nvcc --version | tail -1; git log --oneline -1"
# install: what the interpreter lacks (module:requirement), from GPU_CHECK_WHEELS without network when it is set.
install() {
  local missing=() spec
  for spec in deepspeed:deepspeed==0.19.8 hjson:hjson pydantic:pydantic pytest:pytest ninja:ninja; do
    "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec#*:}")
  done
  if ((${#missing[@]} == 0)); then
    echo "nothing to install"
  elif [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
    "$PY" -m pip install --no-index --find-links "$GPU_CHECK_WHEELS" "${missing[@]}"
  else
    "$PY" -m pip install "${missing[@]}"
  fi
  # this checkout itself (no dependencies): the tests import the support packages by their installed names
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
}
export -f install
export PY
step install 300 setup.log bash -c install
# what every log here came from: commit (dirty or not), versions, machine and GPU, this command line
step provenance 60 setup.log "$PY" -c "import sys; from pathlib import Path; \
from deepspeed_sdp4bit.provenance import write_result; \
write_result(Path(sys.argv[1]), {'script': 'benchmarks/gpu_check.sh'})" "$OUT/provenance.json"
step build 360 build.log bash -c build_ops
step test_codec 300 pytest_codec.log "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" \
  --durations=10 "${CODEC_TESTS[@]}"
# kernels.py's rows for every codec op, with ZeRO++'s rows plugged into its provider list.
step bench_kernels 200 kernels.jsonl "$PY" -c "from sdp4bit_benchmarks import kernels, \
kernels_zeropp; kernels.ROW_PROVIDERS.append(kernels_zeropp.provider); \
kernels.main(['--device', 'cuda', '--json', '--out', '$OUT/kernels'])"
step bench_zeropp 200 zeropp.jsonl "$PY" benchmarks/kernels_zeropp.py --json
IGNORE=()
for t in "${CODEC_TESTS[@]}"; do IGNORE+=(--ignore="$t"); done
step test_other 240 pytest_other.log "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" \
  --durations=10 "${IGNORE[@]}" tests

"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def lines(name):
    path = out / name
    return path.read_text(errors="replace").splitlines() if path.exists() else []

def rows(name):
    found = []
    for line in lines(name):
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found

print("\n== GPU check summary ==")
for line in lines("setup.log")[1:6]:
    print("  " + line)
print(f"{'step':<14}{'exit':>8}{'s':>6}")
for line in lines("steps.tsv"):
    name, rc, seconds = line.split("\t")
    print(f"{name:<14}{rc:>8}{seconds:>6}")
for line in lines("build.log"):
    if line.startswith("BUILD "):
        print("  " + line)
for log in ("pytest_codec.log", "pytest_other.log"):
    words = (" passed", " failed", " error", " skipped", " deselected", "no tests ran")
    tail = [l for l in lines(log) if any(w in l for w in words) and not l.startswith("SKIPPED")]
    print(f"  {log}: {tail[-1].strip('= ') if tail else 'no result line'}")
measured = rows("kernels.jsonl") + rows("zeropp.jsonl")
print(f"\n{'op':<27}{'backend':<10}{'dtype':<6}{'bits':>4} {'parameters':<40}{'ms':>9}{'GB/s':>8}")
for r in measured:
    if "target" in r:
        continue
    keys = ("outputs", "group_size", "in_bits", "pieces", "stochastic", "hadamard")
    extra = " ".join(f"{k}={r[k]}" for k in keys if k in r).replace("group_size", "g").replace("stochastic", "sr").replace(
        "hadamard", "had").replace("outputs=", "")
    ms = "-" if r.get("ms") is None else f"{r['ms']:.4f}"
    gbps = r.get("gbps") if r.get("gbps") is not None else ("ERR" if r.get("error") else "-")
    print(f"{str(r.get('op'))[:26]:<27}{str(r.get('backend'))[:9]:<10}{str(r.get('dtype', '')):<6}"
          f"{str(r.get('bits', '')):>4} {extra[:39]:<40}{ms:>9}{gbps!s:>8}")
print("\nspeed targets (set for an H200):")
for r in measured:
    if "target" in r:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[r["passed"]]
        print(f"  {verdict:<5}{r['target']:<62}{r['value']!s:>8}  {r['goal']}")
EOF
