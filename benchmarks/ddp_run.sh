#!/usr/bin/env bash
# Two-GPU run (issue: rank-consistent decisions under NCCL). Needs 2 GPUs, trl/datasets importable, results/tuner.json.
#   bash benchmarks/ddp_run.sh            # writes benchmarks/results/ddp.json (and ddp_recipe_* files to $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
OUT_DIR="${OUT:-/tmp}"
# 1. the project's multi-GPU recipe, its model replaced by a 0.5B-shaped random model saved locally
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import qwen05_model, tokenizer; \
m = qwen05_model(); m.save_pretrained('/tmp/qwen05'); tokenizer().save_pretrained('/tmp/qwen05')"
timeout 300 accelerate launch --config_file recipes/accelerate/multi_gpu.yaml -m hf_perf_callbacks.train \
  --config cuda-ddp-qwen1.5b --model_name_or_path /tmp/qwen05 --max_steps 6 --output_dir /tmp/ddp_recipe \
  --max_completion_length 32 --dataset_size 64 --save_steps 1000 --logging_steps 1 2>&1 \
  | grep -v -E "Warning|warnings.warn"
cp /tmp/ddp_recipe/perf_log.jsonl "$OUT_DIR/ddp_recipe_perf_log.jsonl" 2>/dev/null
cp /tmp/ddp_recipe/perf_report.md "$OUT_DIR/ddp_recipe_perf_report.md" 2>/dev/null
# 2. throughput aggregation, an OOM on rank 1 only, a watchdog stop on rank 1 only
timeout 400 accelerate launch --config_file recipes/accelerate/multi_gpu.yaml benchmarks/bench_ddp.py 2>&1 \
  | grep -v -E "Warning|warnings.warn|^\{"
