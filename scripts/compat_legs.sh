#!/usr/bin/env bash
# The DeepSpeed/torch pairs this package is tested on besides the default one, each in its own environment made by
# scripts/install.sh (as a user would: SDP4BIT_DEEPSPEED=... SDP4BIT_TORCH=... bash scripts/install.sh), running
# the tests marked `compat` (the version checks, the refusals, the op dispatch, the CPU shared-memory release, and a
# two-rank ZeRO-3 training run whose quantized collectives are recorded and emulated bit for bit).
#   bash scripts/compat_legs.sh install   make (or update) every leg's environment
#   bash scripts/compat_legs.sh test      run the compat tests in each; one summary line per leg (then its five
#                                         slowest tests); fails if any leg does
#   bash scripts/compat_legs.sh ci        each leg in turn: installed (the next one installing while it is tested),
#                                         tested, then removed, so at most two environments are ever on disk
#   bash scripts/compat_legs.sh           install, then test (the environments are kept)
#   SDP4BIT_LEGS_DIR   where the environments go (default <repo>/.venv-legs; about 5.3 GB each)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
legs_dir="${SDP4BIT_LEGS_DIR:-$root/.venv-legs}"
# deepspeed torch (the default pair, DeepSpeed 0.19.8 with torch 2.14.1, is the main suite's)
LEGS=("0.17.6 2.11.0" "0.18.9 2.11.0" "0.19.5 2.14.1" "0.19.8 2.15.0")
phase="${1:-all}"
case "$phase" in install|test|ci|all) ;; *) echo "compat_legs: unknown phase '$phase': use install, test, ci or all" >&2; exit 2;; esac

install_leg() {
  local ds="$1" torch="$2" venv="$legs_dir/ds$1-torch$2" began=$SECONDS
  if SDP4BIT_VENV="$venv" SDP4BIT_DEEPSPEED="$ds" SDP4BIT_TORCH="torch==$torch" bash "$root/scripts/install.sh" \
      > "$venv.install.log" 2>&1; then
    echo "compat leg deepspeed $ds torch $torch: environment ready in $((SECONDS - began)) s"
  else
    echo "compat leg deepspeed $ds torch $torch: install FAILED (last lines of $venv.install.log):"
    tail -5 "$venv.install.log"
    return 1
  fi
}

test_leg() {
  local ds="$1" torch="$2" venv="$legs_dir/ds$1-torch$2" began=$SECONDS summary
  # compiled ops from scratch, in a folder of the leg's own (the build commands name the leg's venv, so ninja would
  # rebuild in a folder shared by the legs of one torch anyway); all of them are removed on exit
  local extensions="$extensions_root/ds$ds-torch$torch"
  mkdir -p "$extensions"
  # the two ops its tests load are compiled beside the first tests (sdp4bit_testing/prebuild.py)
  (cd "$root" && export PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$extensions" TOKENIZERS_PARALLELISM=false \
      SDP4BIT_HYPOTHESIS_PROFILE="${SDP4BIT_HYPOTHESIS_PROFILE:-ci}" &&
      { "$venv/bin/python" -m sdp4bit_testing.prebuild deepspeed-shm codec-cpu > "$venv.prebuild.log" 2>&1 &
        "$venv/bin/python" -m pytest -q -m compat -rfEs --durations=5 -p no:cacheprovider tests > "$venv.test.log" 2>&1
        rc=$?; wait; exit $rc; })
  local rc=$?
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$venv.test.log" | tail -1)"
  echo "compat leg deepspeed $ds torch $torch ($("$venv/bin/python" -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)): ${summary:-no summary} [$((SECONDS - began)) s]"
  # where the leg's time goes: its five slowest tests
  grep -A5 "slowest 5 durations" "$venv.test.log" | tail -5 | sed 's/^/  /'
  if [ $rc -ne 0 ]; then
    grep -E "^(FAILED|ERROR)" "$venv.test.log" | head -20
  fi
  return $rc
}

# Each leg installed while the one before it is tested, and removed once tested: a leg's environment is over 5 GB
# (torch's CUDA build), and four of them beside the main one fill a CI machine's disk.
run_ci() {
  local i leg next pid rc
  # shellcheck disable=SC2086
  set -- ${LEGS[0]}
  install_leg "$1" "$2" > "$legs_dir/leg0.out" 2>&1 &
  pid=$!
  for i in "${!LEGS[@]}"; do
    leg="${LEGS[$i]}"
    wait "$pid"; rc=$?
    cat "$legs_dir/leg$i.out"; rm -f "$legs_dir/leg$i.out"
    next=$((i + 1))
    if [ "$next" -lt "${#LEGS[@]}" ]; then
      # shellcheck disable=SC2086
      set -- ${LEGS[$next]}
      install_leg "$1" "$2" > "$legs_dir/leg$next.out" 2>&1 &
      pid=$!
    fi
    # shellcheck disable=SC2086
    set -- $leg
    if [ $rc -eq 0 ]; then test_leg "$1" "$2" || failed=1; else failed=1; fi
    rm -rf "$legs_dir/ds$1-torch$2"
  done
}

mkdir -p "$legs_dir"
extensions_root="$(mktemp -d "${TMPDIR:-/tmp}/sdp4bit-leg-extensions.XXXXXX")"
trap 'rm -rf "$extensions_root"' EXIT
failed=0
if [ "$phase" = ci ]; then
  export root legs_dir
  run_ci
  exit $failed
fi
if [ "$phase" != test ]; then
  # two environments at a time (an install keeps one core busy unpacking); xargs exits non-zero if any failed
  export root legs_dir
  export -f install_leg
  printf '%s\n' "${LEGS[@]}" | xargs -P 2 -L 1 bash -c 'install_leg "$0" "$1"' || failed=1
fi
if [ "$phase" != install ]; then
  for leg in "${LEGS[@]}"; do
    # shellcheck disable=SC2086
    set -- $leg
    [ -x "$legs_dir/ds$1-torch$2/bin/python" ] || { echo "compat leg deepspeed $1 torch $2: no environment"; failed=1; continue; }
    test_leg "$1" "$2" || failed=1
  done
fi
exit $failed
