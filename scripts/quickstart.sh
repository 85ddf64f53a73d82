#!/usr/bin/env bash
# The README's first command: install, prepare the offline data, train a GPT twice (plain ZeRO-3, then ZeRO-3
# with SDP4Bit), print both final validation losses and both runs' bytes per step, and plot the loss curves.
#   no GPU:   the `tiny` GPT on 4 CPU ranks arranged as 2 simulated nodes of 2 ranks (configs/cpu/)
#   N GPUs:   the 125M GPT on the N GPUs, as 2 simulated nodes of N/2 GPUs when N is even (configs/125m/)
# Environment: QUICKSTART_STEPS (training steps per run), QUICKSTART_OUT (default runs/quickstart).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
began=$(date +%s)
bash scripts/install.sh
# shellcheck disable=SC1091
. "${SDP4BIT_VENV:-$root/.venv}/bin/activate"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.torch_extensions}"
export TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"
out="${QUICKSTART_OUT:-runs/quickstart}"
data=data/pydoc/tokens

if [ ! -f "$data.json" ]; then
  python examples/prepare_data.py --output_prefix "$data"
fi

gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null | tail -1)
port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

if [ "$gpus" -ge 1 ]; then
  steps="${QUICKSTART_STEPS:-300}"
  launch=(deepspeed --num_gpus "$gpus")
  model=(--model 125m --seq_len 512 --micro_batch 8 --global_batch $((8 * gpus)) --train_iters "$steps"
         --lr_decay_iters "$steps" --warmup_fraction 0.05 --eval_interval 50 --comms_logger)
  baseline=configs/125m/baseline.json
  sdp4bit=configs/125m/sdp4bit.json
  if [ $((gpus % 2)) -eq 0 ]; then
    nodes=(--ds_set "sdp4bit.ranks_per_node=$((gpus / 2))")
    echo "quickstart: $gpus GPUs as 2 simulated nodes of $((gpus / 2))"
  else
    nodes=()
    echo "quickstart: $gpus GPU(s) on one node (SDP4Bit then quantizes only what one node exchanges)"
  fi
else
  steps="${QUICKSTART_STEPS:-200}"
  launch=(deepspeed --num_accelerators 4)
  model=(--model tiny --train_iters "$steps" --lr_decay_iters "$steps" --eval_interval 50 --precision fp32
         --comms_logger)
  baseline=configs/cpu/tiny_baseline.json
  sdp4bit=configs/cpu/tiny_sdp4bit.json
  nodes=()
  echo "quickstart: no GPU; 4 CPU ranks as 2 simulated nodes of 2 ranks"
fi

for run in baseline sdp4bit; do
  config=$baseline
  extra=()
  if [ "$run" = sdp4bit ]; then config=$sdp4bit; extra=("${nodes[@]}"); fi
  echo "quickstart: training $run ($config, $steps steps; full output in $out/$run.log)"
  mkdir -p "$out"
  rm -f "$out/$run/summary.json"
  "${launch[@]}" --master_port "$(port)" examples/train_gpt.py "${model[@]}" --deepspeed_config "$config" \
    --data "$data" --out "$out/$run" "${extra[@]}" 2>&1 | tee "$out/$run.log" || true
  if [ ! -f "$out/$run/summary.json" ]; then
    echo "quickstart: the $run run failed; see $out/$run.log" >&2
    exit 1
  fi
done

python examples/plot_runs.py "$out/baseline" "$out/sdp4bit" --labels baseline SDP4Bit --out "$out/loss.png"
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
b, s = (json.load(open(f"{out}/{name}/summary.json")) for name in ("baseline", "sdp4bit"))
print(f"final validation loss: baseline {b['final_val_loss']:.4f}, SDP4Bit {s['final_val_loss']:.4f} "
      f"({s['final_val_loss'] / b['final_val_loss'] - 1:+.2%})")
mb_b, mb_s = b["comm_bytes_per_step"] or 0.0, s["comm_bytes_per_step"] or 0.0
ratio = f"reduction {mb_b / mb_s:.2f}x" if mb_b and mb_s else "no collectives with a single rank"
print(f"bytes per rank per step, all collectives (DeepSpeed comms logger, steady state): "
      f"baseline {mb_b / 1e6:.3f} MB, SDP4Bit {mb_s / 1e6:.3f} MB ({ratio})")
kinds = s.get("sdp4bit_bytes_per_step") or {}
for kind in ("weight_refresh", "weight_gather", "grad_intra", "grad_inter", "total"):
    wire, logical = kinds.get(f"{kind}_wire", 0.0), kinds.get(f"{kind}_logical", 0.0)
    if logical:
        print(f"  SDP4Bit {kind:<14} {wire / 1e6:8.3f} MB passed for {logical / 1e6:8.3f} MB unquantized "
              f"({wire / logical:.1%})")
if kinds.get("total_cross"):
    print(f"  SDP4Bit sends {kinds['total_cross'] / 1e6:.3f} MB per rank per step to other nodes "
          f"(weight_refresh + grad_inter as they travel; benchmarks/two_nodes.py measures the baseline's on a link)")
if not s.get("sdp4bit"):
    print("WARNING: SDP4Bit was not attached to the engine in the SDP4Bit run")
PY
echo "quickstart: done in $(( $(date +%s) - began )) s; plot: $out/loss.png"
