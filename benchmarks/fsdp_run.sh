#!/usr/bin/env bash
# Two-GPU FSDP2 run (issue 16: the callbacks and the tuner under FSDP through accelerate launch). Needs 2 GPUs.
#   bash benchmarks/fsdp_run.sh            # writes benchmarks/results/fsdp.json and fsdp_oom.json (copies to $OUT if set)
#   bash benchmarks/fsdp_run.sh --smoke    # the same on 2 CPU processes (gloo, tiny model): fsdp_smoke*.json
# Under 8 minutes: each launch has its own timeout (250 + 100 + 100 s).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--smoke" ]; then
  export OMP_NUM_THREADS=1
  LAUNCH=("$PY" -m torch.distributed.run --nproc_per_node 2 --master_port 29561)
  FLAG=(--smoke); NAME=fsdp_smoke
else
  LAUNCH=(accelerate launch --config_file hf_perf_callbacks/recipes/accelerate/fsdp.yaml)
  FLAG=(); NAME=fsdp
fi
LOG="${TMPDIR:-/tmp}/hf_perf_fsdp_run.log"
# 1. the callbacks on a plain Trainer, a watchdog re-size request on rank 1 under train_with_tuning, a stop on rank 1
timeout 250 "${LAUNCH[@]}" benchmarks/bench_fsdp.py "${FLAG[@]}" 2>&1 | grep -v -E "Warning|warnings.warn|^\{"
# 2. an OOM inside rank 1's step: refused under FSDP, so the run must end at once (not hang) and say why
start=$(date +%s)
timeout 100 "${LAUNCH[@]}" benchmarks/bench_fsdp.py oom "${FLAG[@]}" > "$LOG" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
said=$(grep -c "out of memory under FSDP: not recoverable in lockstep" "$LOG")
echo "OOM on rank 1 under FSDP: exit code $rc (non-zero expected, 124 = hung until the timeout) after ${elapsed} s;" \
     "refusal message printed ${said} time(s)"
"$PY" - "$rc" "$elapsed" "$said" "$NAME" <<'PY'
import json, os, sys
rc, elapsed, said, name = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
path = os.path.join("benchmarks", "results", f"{name}_oom.json")
data = json.load(open(path)) if os.path.exists(path) else {"benchmark": f"{name}_oom", "rank1_record": None}
data.update(launch_exit_code=rc, launch_seconds=elapsed, hung=rc == 124, message_printed=said > 0)
json.dump(data, open(path, "w"), indent=1)
if os.environ.get("OUT"):
    json.dump(data, open(os.path.join(os.environ["OUT"], f"{name}_oom.json"), "w"), indent=1)
PY
# 3. GPUs only: the FSDP recipe end to end, its 7B model replaced by a 0.5B-shaped random model saved locally
if [ "${1:-}" != "--smoke" ]; then
  "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from common import tokenizer; \
from bench_fsdp import build_model; m = build_model(); m.save_pretrained('/tmp/qwen05_fsdp'); \
tokenizer().save_pretrained('/tmp/qwen05_fsdp')"
  timeout 100 accelerate launch --config_file hf_perf_callbacks/recipes/accelerate/fsdp.yaml -m hf_perf_callbacks.train \
    --config cuda-fsdp-qwen7b --model_name_or_path /tmp/qwen05_fsdp --max_steps 4 \
    --output_dir /tmp/fsdp_recipe --max_completion_length 32 --dataset_size 64 --save_steps 1000 --logging_steps 1 \
    --report false 2>&1 | grep -v -E "Warning|warnings.warn" | tail -20
  cp /tmp/fsdp_recipe/perf_log.jsonl "${OUT:-/tmp}/fsdp_recipe_perf_log.jsonl" 2>/dev/null
fi
