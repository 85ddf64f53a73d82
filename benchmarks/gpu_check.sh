#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA GPU (docs/gpu_check.md says how to run and read it).
#
# Installs what the interpreter lacks (with pip, or offline from a wheel folder given as GPU_CHECK_WHEELS, made by
# scripts/gpu_wheelhouse.py), this checkout and dev/ editable; imports every module the check uses; JIT-builds our
# CUDA codec op and DeepSpeed's ZeRO++ quantizer op in parallel; runs the codec's GPU tests, a few steps of a one-rank
# engine of each ZeRO stage with the README's block (benchmarks/zero_stages.py), the kernel benchmarks
# (benchmarks/codec_kernels.py --device cuda with ZeRO++'s rows plugged in, and benchmarks/kernels_zeropp.py's
# head-to-head with the H200 speed targets), and the other GPU tests if time is left. Every log goes under $OUT; the details, then
# a short table of the steps come last. Each step has a time limit inside an overall budget (GPU_CHECK_BUDGET_S,
# default 600 s), so the summary always comes out; the exit status is 0 when every step passed.
#
# GPU_CHECK_PREFLIGHT=1 runs the CPU pre-flight instead, on a machine with network and no GPU: it makes the wheel
# folder for the local interpreter (unless GPU_CHECK_WHEELS names one), a new venv with torch (pip's usual sources)
# and everything else installed from the folder alone, then collects the GPU tests, imports every module of the check
# and trains two steps of a ZeRO-3 engine on the CPU; it prints one line, and exits non-zero on any failure.
#   PYTHON              interpreter with a CUDA build of torch (default python3); the pre-flight's venv is made from it
#   OUT                 log folder (default runs/gpu_check, runs/gpu_check_preflight for the pre-flight)
#   GPU_CHECK_WHEELS    a wheel folder to install from without network (pip --no-index --find-links)
#   GPU_CHECK_BUDGET_S  overall time limit in seconds (default 600)
#   GPU_CHECK_PREFLIGHT_TORCH  the pre-flight venv's torch requirement (default torch==2.13.0, a CPU build)
#   TORCH_CUDA_ARCH_LIST, MAX_JOBS   architectures and parallel compiles of the op builds (default: the visible
#                       GPUs' architectures, all cores)
#   TORCH_EXTENSIONS_DIR  where the ops are built and loaded from (default: .torch_extensions in this checkout); it
#                       must belong to you and be writable by no one else, since the tests import the .so files in it
# shellcheck disable=SC2317  # the functions run in the steps' own bash (export -f), which shellcheck does not follow
set -uo pipefail
if [[ -n ${GPU_CHECK_WHEELS:-} ]]; then  # a folder named from where the script was started
  GPU_CHECK_WHEELS=$(cd "$GPU_CHECK_WHEELS" && pwd) || { echo "gpu_check: GPU_CHECK_WHEELS is no folder" >&2; exit 2; }
fi
cd "$(dirname "$0")/.." || exit 1

PREFLIGHT=${GPU_CHECK_PREFLIGHT:-0}
if [[ $PREFLIGHT == 1 ]]; then
  OUT=${OUT:-$PWD/runs/gpu_check_preflight}
else
  OUT=${OUT:-$PWD/runs/gpu_check}
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
(umask 077 && mkdir -p "$TORCH_EXTENSIONS_DIR")
if [[ ! -O "$TORCH_EXTENSIONS_DIR" ]] || [[ -n "$(find "$TORCH_EXTENSIONS_DIR" -maxdepth 0 -perm /022)" ]]; then
  echo "gpu_check: TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR must be a folder you own that no one else can write" \
       "to (the ops' .so files are imported from it); use another folder or chmod go-w it" >&2
  exit 2
fi
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-600}
BEGIN=$(date +%s)
DEADLINE=$((BEGIN + BUDGET))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOGS=(steps.tsv summary.txt setup.log wheels.log build.log collect.log pytest_codec.log pytest_other.log kernels.jsonl
  engines.jsonl)
for log in "${LOGS[@]}"; do rm -f "$OUT/$log"; done
touch "$OUT/steps.tsv"

# The modules the check imports: its own commands below, the GPU test files and the benchmarks it runs, and the
# pytest plugins; the imports step imports each of them (tests/test_gpu_check_script.py keeps the list complete).
IMPORTS="deepspeed deepspeed.accelerator deepspeed.ops.op_builder deepspeed.ops.op_builder.builder
  deepspeed.runtime.engine deepspeed_sdp4bit deepspeed_sdp4bit.codec deepspeed_sdp4bit.codec.compiled
  deepspeed_sdp4bit.codec.reference deepspeed_sdp4bit.codec.spec deepspeed_sdp4bit.collectives
  deepspeed_sdp4bit.collectives.accounting deepspeed_sdp4bit.collectives.sharding
  deepspeed_sdp4bit.collectives.weight_direct deepspeed_sdp4bit.collectives.weight_store deepspeed_sdp4bit.config
  deepspeed_sdp4bit.core.engine_patches deepspeed_sdp4bit.ops deepspeed_sdp4bit.ops.builder
  deepspeed_sdp4bit.provenance deepspeed_sdp4bit.topology deepspeed_sdp4bit.zero3.checks hypothesis pytest
  pytest_timeout sdp4bit_benchmarks sdp4bit_benchmarks.codec_kernels sdp4bit_benchmarks.codec_share
  sdp4bit_benchmarks.kernels_zeropp sdp4bit_benchmarks.timing sdp4bit_benchmarks.zero_stages sdp4bit_examples
  sdp4bit_examples.gpt_models sdp4bit_testing sdp4bit_testing.builders sdp4bit_testing.dist_harness
  sdp4bit_testing.node_jobs sdp4bit_testing.row_checks sdp4bit_testing.tail_checks sdp4bit_testing.toolkit
  sdp4bit_testing.zero12_harness sdp4bit_testing.zero3_harness torch torch.distributed torch.profiler
  torch.utils.cpp_extension transformers transformers.models.gpt2.modeling_gpt2"
# What the install step asks pip for besides this checkout (whose requirements it brings) and dev/.
REQUIREMENTS="deepspeed==0.19.8 nvidia-ml-py pytest>=8 pytest-timeout>=2.3 hypothesis>=6.100 setuptools>=68"
# What a GPU machine comes with besides torch, which the pre-flight's new venv gets from the wheel folder too.
BASE="numpy ninja transformers"
CODEC_TESTS=(tests/test_codec_backends.py tests/test_op_builder_cuda.py)
OTHER_TESTS=(tests/test_zero3_gpu.py tests/test_zero12_gpu.py tests/test_weight_gather.py tests/test_zero3_setups.py)

# step NAME LIMIT_S LOG CMD...: run CMD with its output in $OUT/LOG, at most LIMIT_S and never past the deadline
# (15 s kept for the summary); record name, exit status, seconds and log in steps.tsv, and say so (the pre-flight
# says only its summary line).
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((DEADLINE - $(date +%s) - 15))
  ((left < limit)) && limit=$left
  if ((limit <= 0)); then
    printf '%s\tskipped\t0\t%s\n' "$name" "$log" >> "$OUT/steps.tsv"
    [[ $PREFLIGHT == 1 ]] || echo "$name: skipped (budget used up)"
    return
  fi
  local start rc
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*" >> "$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$log" >> "$OUT/steps.tsv"
  [[ $PREFLIGHT == 1 ]] || echo "$name: exit $rc after $(($(date +%s) - start)) s"
}

# passed: whether every step so far exited 0
passed() {
  ! cut -f2 "$OUT/steps.tsv" | grep -qvx 0
}

# pip_install ARGS...: pip of $PY; with GPU_CHECK_WHEELS, from that folder alone (no index, no pip configuration).
# Nothing is byte-compiled at install: the modules the check imports are compiled as they are first imported.
pip_install() {
  if [[ -n $GPU_CHECK_WHEELS ]]; then
    env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
      "$PY" -m pip install --no-compile --no-index --find-links "$GPU_CHECK_WHEELS" "$@"
  else
    "$PY" -m pip install --no-compile "$@"
  fi
}

# install [EXTRA...]: the requirements (and EXTRA), this checkout editable with its requirements, then dev/ (the
# tests' harness, the benchmarks and examples as packages) editable without its own: pip keeps what is installed.
install() {
  # shellcheck disable=SC2086  # the list's words are the requirements
  (set -f && pip_install "$@" $REQUIREMENTS -e . && pip_install --no-deps -e dev)
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

# import_all: import every module of IMPORTS, one line each; fails if any does not import.
import_all() {
  # shellcheck disable=SC2086  # the list's words are the modules
  "$PY" - $IMPORTS <<'EOF'
import contextlib, importlib, sys, traceback

names, failed = sys.argv[1:], []
for name in names:
    try:
        with contextlib.redirect_stdout(sys.stderr):
            importlib.import_module(name)
    except Exception:
        failed.append(name)
        traceback.print_exc()
print(f"imported {len(names) - len(failed)} of {len(names)} modules" + (f"; FAILED: {failed}" if failed else ""))
sys.exit(1 if failed else 0)
EOF
}

# environment: the GPU, its driver and clocks, Python, torch and its CUDA, nvcc, the commit; fails without a GPU
environment() {
  local rc=0
  git log --oneline -1
  nvcc --version | tail -1
  nvidia-smi -L || rc=1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || rc=1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', \
torch.version.cuda, torch.cuda.get_device_name())" || rc=1
  return "$rc"
}

# provenance: what every log here came from (commit and whether the tree is dirty, versions, machine, GPU)
provenance() {
  "$PY" -c "import json; from deepspeed_sdp4bit.provenance import with_provenance; \
print(json.dumps(with_provenance({'script': 'benchmarks/gpu_check.sh'}), indent=1))"
}

# make_venv: the pre-flight's new venv, with torch from pip's usual sources; the steps after it use its python.
make_venv() {
  local venv=$WORK/venv/bin/python
  "$PY" -m venv "$WORK/venv" && "$venv" -m pip install -q --no-compile "${GPU_CHECK_PREFLIGHT_TORCH:-torch==2.13.0}" &&
    "$venv" -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__}')"
}
export -f pip_install install build_ops import_all environment provenance make_venv
export PY WORK IMPORTS REQUIREMENTS GPU_CHECK_WHEELS=${GPU_CHECK_WHEELS:-}

# run NAME LIMIT_S LOG FUNCTION [ARGS...]: step with one of the functions above, in its own bash (timeout runs it)
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  step "$name" "$limit" "$log" bash -c '"$@"' _ "$@"
}

PYTEST=(-m pytest -q -rs -p no:cacheprovider)
if [[ $PREFLIGHT == 1 ]]; then
  # the wheel folder is made while the venv's torch installs
  if [[ -z $GPU_CHECK_WHEELS ]]; then
    GPU_CHECK_WHEELS=$WORK/wheels
    step wheels 300 wheels.log "$PY" scripts/gpu_wheelhouse.py --local --with-base --out "$GPU_CHECK_WHEELS" &
  fi
  run venv 240 setup.log make_venv
  wait
  PY=$WORK/venv/bin/python
  # each step from here on only after all before it passed
  # shellcheck disable=SC2086  # the list's words are the packages
  passed && run install 180 setup.log install $BASE
  passed && run imports 90 setup.log import_all
  passed && step collect 120 collect.log "$PY" "${PYTEST[@]}" --collect-only -m gpu "${CODEC_TESTS[@]}" \
    "${OTHER_TESTS[@]}"
  # the reference codec: the CPU op's build is the test suite's concern, this run checks the install
  passed && step engines 180 engines.jsonl env SDP4BIT_CODEC_BACKEND=reference "$PY" -m sdp4bit_benchmarks.zero_stages \
    --device cpu --stages 3 --steps 2 --model tiny --seq-len 64 --micro-batch 4 --json
  "${PYTHON:-python3}" benchmarks/gpu_check_summary.py "$OUT" --preflight --seconds $(($(date +%s) - BEGIN)) |
    tee "$OUT/summary.txt"
  exit "${PIPESTATUS[0]}"
fi

run env 30 setup.log environment
run install 150 setup.log install
PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout=180)
run imports 60 setup.log import_all
run provenance 30 setup.log provenance
run build 300 build.log build_ops
PYTEST+=("${PYTEST_TIMEOUT[@]}" --durations=10)
step test_codec 150 pytest_codec.log "$PY" "${PYTEST[@]}" -m gpu "${CODEC_TESTS[@]}"
step engines 150 engines.jsonl "$PY" -m sdp4bit_benchmarks.zero_stages --device cuda --json
# codec_kernels.py's rows for every codec op, with ZeRO++'s rows plugged into its provider list.
step bench_kernels 100 kernels.jsonl "$PY" -c "from sdp4bit_benchmarks import codec_kernels, \
kernels_zeropp; codec_kernels.ROW_PROVIDERS.append(kernels_zeropp.provider); \
codec_kernels.main(['--device', 'cuda', '--json', '--out', '$WORK/kernels'])"
step bench_zeropp 100 kernels.jsonl "$PY" -m sdp4bit_benchmarks.kernels_zeropp --json
step test_other 150 pytest_other.log "$PY" "${PYTEST[@]}" -m gpu "${OTHER_TESTS[@]}"

"$PY" benchmarks/gpu_check_summary.py "$OUT" --budget "$BUDGET" --seconds $(($(date +%s) - BEGIN)) \
  --optional test_other | tee "$OUT/summary.txt"
exit "${PIPESTATUS[0]}"
