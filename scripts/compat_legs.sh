#!/usr/bin/env bash
# The DeepSpeed/torch pairs this package is tested on besides the default one, running the tests marked `compat` (the
# version checks, the refusals, the op dispatch, the CPU shared-memory release, and two-rank training runs whose
# quantized collectives are recorded and emulated bit for bit). The legs on one torch release share one environment,
# made by scripts/install.sh as a user would (SDP4BIT_DEEPSPEED=... SDP4BIT_TORCH=... bash scripts/install.sh), which
# swaps its DeepSpeed release between them: pip replaces DeepSpeed in well under a minute, while a torch release with
# its CUDA libraries takes minutes to unpack and over 5 GB of disk.
#   bash scripts/compat_legs.sh install   make (or update) each torch release's environment
#   bash scripts/compat_legs.sh test      each leg in turn: its DeepSpeed release put into its torch's environment,
#                                         the compat tests run (on an older release, those marked older_release);
#                                         one summary line per leg (then its five slowest tests); fails if any does
#   bash scripts/compat_legs.sh ci        each torch's environment made (the next one while the legs before it are
#                                         tested), its legs tested, then removed: at most two environments on disk
#   bash scripts/compat_legs.sh           install, then test (the environments are kept)
#   SDP4BIT_LEGS_DIR   where the environments go (default <repo>/.venv-legs; about 5.5 GB each)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
legs_dir="${SDP4BIT_LEGS_DIR:-$root/.venv-legs}"
# deepspeed torch, the legs of one torch release next to each other (the default pair, DeepSpeed 0.19.8 with torch
# 2.14.1, is the main suite's); each runs the tests marked compat
LEGS=("0.17.6 2.11.0" "0.18.9 2.11.0" "0.19.5 2.15.0" "0.19.8 2.15.0")
# deepspeed torch, releases older than the supported range, put into their torch's environment after its legs: the
# tests marked older_release (the package imports, initialize names the supported range)
OLDER=("0.16.9 2.11.0")
phase="${1:-all}"
case "$phase" in install|test|ci|all) ;; *) echo "compat_legs: unknown phase '$phase': use install, test, ci or all" >&2; exit 2;; esac

# the torch releases of the legs, each once, in the legs' order
torches() {
  local leg seen=" "
  for leg in "${LEGS[@]}"; do
    # shellcheck disable=SC2086
    set -- $leg
    case "$seen" in *" $2 "*) ;; *) seen="$seen$2 "; echo "$2" ;; esac
  done
}

# the first DeepSpeed release tested on torch release $1 (the one its environment is made with)
first_deepspeed() {
  local leg torch="$1"
  for leg in "${LEGS[@]}"; do
    # shellcheck disable=SC2086
    set -- $leg
    [ "$2" = "$torch" ] && { echo "$1"; return; }
  done
}

# the environment of torch release $1
env_of() {
  echo "$legs_dir/torch$1"
}

# Run a command (from $3 on) into log $2, then print "$1 in N s", or $1's install failure with the log's last lines.
logged_install() {
  local what="$1" log="$2" began=$SECONDS
  shift 2
  if "$@" > "$log" 2>&1; then
    echo "$what in $((SECONDS - began)) s"
  else
    echo "${what%%:*}: install FAILED (last lines of $log):"
    tail -5 "$log"
    return 1
  fi
}

# DeepSpeed release $1 and torch release $2 installed into torch's environment (made if absent; its DeepSpeed replaced
# when it differs; a second or so when all is there already)
install_leg() {
  local ds="$1" torch="$2" done_as="${3:-deepspeed in place}"
  logged_install "compat leg deepspeed $ds torch $torch: $done_as" "$legs_dir/ds$ds-torch$torch.install.log" \
    env SDP4BIT_VENV="$(env_of "$torch")" SDP4BIT_DEEPSPEED="$ds" SDP4BIT_TORCH="torch==$torch" \
    bash "$root/scripts/install.sh"
}

# DeepSpeed release $1, older than the supported range, put into torch release $2's environment without its
# dependencies, as a user who pins it beside this package has it (pip would replace it to satisfy the package's range)
put_older() {
  local ds="$1" torch="$2"
  logged_install "older release deepspeed $ds torch $torch: deepspeed in place" \
    "$legs_dir/ds$ds-torch$torch.install.log" \
    "$(env_of "$torch")/bin/python" -m pip install -q --no-deps "deepspeed==$ds"
}

# The tests marked $3 (default compat) on DeepSpeed release $1 in torch release $2's environment.
test_leg() {
  local ds="$1" torch="$2" marker="${3:-compat}" venv began=$SECONDS summary log="$legs_dir/ds$1-torch$2"
  venv="$(env_of "$torch")"
  # compiled ops from scratch, in a folder of the environment's own (the build commands name its venv), shared by its
  # legs: ninja rebuilds what a swapped DeepSpeed changed and keeps the codec op; all of them are removed on exit
  local extensions="$extensions_root/torch$torch"
  mkdir -p "$extensions"
  # the two ops the compat tests load are compiled beside the first tests (sdp4bit_testing/prebuild.py)
  local ops=(deepspeed-shm codec-cpu)
  [ "$marker" = compat ] || ops=()
  (cd "$root" && export PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$extensions" TOKENIZERS_PARALLELISM=false \
      SDP4BIT_HYPOTHESIS_PROFILE="${SDP4BIT_HYPOTHESIS_PROFILE:-ci}" &&
      { [ ${#ops[@]} -eq 0 ] || "$venv/bin/python" -m sdp4bit_testing.prebuild "${ops[@]}" > "$log.prebuild.log" 2>&1 &
        "$venv/bin/python" -m pytest -q -m "$marker" -rfEs --durations=5 -p no:cacheprovider tests > "$log.test.log" 2>&1
        rc=$?; wait; exit $rc; })
  local rc=$?
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log.test.log" | tail -1)"
  local label="compat leg"
  [ "$marker" = compat ] || label="older release"
  echo "$label deepspeed $ds torch $torch ($("$venv/bin/python" -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)): ${summary:-no summary} [$((SECONDS - began)) s]"
  # where the leg's time goes: its five slowest tests
  grep -A5 "slowest 5 durations" "$log.test.log" | grep -E "^[0-9.]+s " | sed 's/^/  /'
  if [ $rc -ne 0 ]; then
    grep -E "^(FAILED|ERROR)" "$log.test.log" | head -20
  fi
  return $rc
}

# The legs of torch release $1, in turn, then its older releases: each one's DeepSpeed put in (the first one's is
# there already), then tested.
test_legs_on() {
  local leg marker torch="$1"
  for leg in "${LEGS[@]/%/ compat}" "${OLDER[@]/%/ older_release}"; do
    # shellcheck disable=SC2086
    set -- $leg
    [ "$2" = "$torch" ] || continue
    marker="$3"
    if [ "$marker" = compat ]; then install_leg "$1" "$2"; else put_older "$1" "$2"; fi &&
      { test_leg "$1" "$2" "$marker" || failed=1; } || failed=1
  done
}

# Each torch release's environment made while the legs before it are tested, and removed once its legs are: an
# environment is over 5 GB (torch's CUDA build), and several beside the main one fill a CI machine's disk.
run_ci() {
  local i torch next pid rc
  local -a all
  mapfile -t all < <(torches)
  install_leg "$(first_deepspeed "${all[0]}")" "${all[0]}" "environment made" > "$legs_dir/env0.out" 2>&1 &
  pid=$!
  for i in "${!all[@]}"; do
    torch="${all[$i]}"
    wait "$pid"; rc=$?
    cat "$legs_dir/env$i.out"; rm -f "$legs_dir/env$i.out"
    next=$((i + 1))
    if [ "$next" -lt "${#all[@]}" ]; then
      install_leg "$(first_deepspeed "${all[$next]}")" "${all[$next]}" "environment made" \
        > "$legs_dir/env$next.out" 2>&1 &
      pid=$!
    fi
    if [ $rc -eq 0 ]; then test_legs_on "$torch"; else failed=1; fi
    rm -rf "$(env_of "$torch")"
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
  export -f install_leg logged_install env_of
  for torch in $(torches); do echo "$(first_deepspeed "$torch") $torch"; done |
    xargs -P 2 -L 1 bash -c 'install_leg "$0" "$1" "environment made"' || failed=1
fi
if [ "$phase" != install ]; then
  for torch in $(torches); do
    [ -x "$(env_of "$torch")/bin/python" ] || { echo "compat legs on torch $torch: no environment"; failed=1; continue; }
    test_legs_on "$torch"
  done
fi
exit $failed
