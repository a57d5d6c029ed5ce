#!/usr/bin/env bash
# DeepSpeed ZeRO-2 and ZeRO-3 on the GPUs of one host: the callbacks and train_with_tuning, end to end, with the
# scenarios of tests/test_deepspeed.py (tests/scripts/two_rank_deepspeed.py) on real GPUs over NCCL.
#   bash benchmarks/deepspeed.sh            # every GPU of the host (NGPU=N to choose); results/deepspeed_<card>.json
#                                           # (<card>: h100, h200; NGPU other than 2: deepspeed_<card>_<N>gpu.json)
#   STAGES="3" / SCENARIOS="main restart one" choose (PLAN="2:main 3:restart" names the runs in order instead);
#   LIMIT: seconds per launch (default 240); results also go to $OUT when set.
# Needs torch, transformers, accelerate and deepspeed (carry its wheel and hjson, pydantic: pip install --no-index).
#  main:    the meter's tokens against an independent count of the inputs' tokens, its rates on every rank; a
#           watchdog stop on the last rank stopping every rank; a watchdog re-size on rank 1 in the same process
#           (DeepSpeed's checkpoint, a new engine, its split agreeing with args and the DeepSpeed config); the same
#           re-size against an unfaulted run: samples of every step, learning rates, weights (SGD + momentum)
#  restart: an OOM planted on rank 0 at step 5 ends the launch with the split recorded; the relaunch resumes from
#           checkpoint-4 and trains steps 5-8 as the unfaulted run does
#  one:     one process: an OOM planted at step 3 recovered in the same process, exactly
#  grpo:    GRPO (LoRA) under ZeRO: the watchdog's request on rank 1 re-sizes every rank in process, the groups
#           and the generation batch kept, against a run that never re-sized (needs trl and datasets)
#  accelerate: the main scenario under `accelerate launch --config_file recipes/accelerate/deepspeed_zero<stage>.yaml`
#           (DeepSpeed's plugin from the launcher's environment, nothing in TrainingArguments)
# Stages and scenarios not run keep their figures from the result file already there (each says its date).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH="${PYTHONPATH:-}:$PWD" HANG_DUMP_SEC="${HANG_DUMP_SEC:-200}"
PY="${PYTHON:-python3}"
"$PY" -c "import torch, transformers, accelerate, deepspeed" || {
  echo "deepspeed.sh needs torch, transformers, accelerate and deepspeed importable by $PY" >&2; exit 2; }
N="${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}"
RUN="/tmp/hf_perf_deepspeed/$$"
mkdir -p "$RUN"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
COMMANDS="$RUN/commands.txt"; : > "$COMMANDS"
record() {  # record NAME COMMAND...: runs it (environment words like FROM_LAUNCHER=1 first); the command, exit code, seconds
  local name="$1"; shift
  local t0; t0=$(date +%s)
  timeout "${LIMIT:-240}" env "$@" > "$RUN/$name.log" 2>&1
  local rc=$?
  echo "$name	$rc	$(( $(date +%s) - t0 ))	$*" >> "$COMMANDS"
  echo "$name: exit code $rc"
  [ "$rc" -ne 0 ] && grep -v -E "Warning|warnings.warn|return func" "$RUN/$name.log" | tail -n 15
  return 0
}
timed() {  # timed NAME NPROC ARGS...: the script launched on NPROC ranks
  local name="$1" n="$2"; shift 2
  record "$name" "$PY" -m torch.distributed.run --nproc_per_node "$n" --master_port "$(free_port)" \
    tests/scripts/two_rank_deepspeed.py "$@"
}
launched() {  # launched NAME NPROC STAGE: the main scenario under `accelerate launch` with the shipped ZeRO config
  local name="$1" n="$2" stage="$3"
  record "$name" FROM_LAUNCHER=1 "$PY" -m accelerate.commands.launch \
    --config_file "recipes/accelerate/deepspeed_zero${stage}.yaml" --num_processes "$n" --mixed_precision no \
    --main_process_port "$(free_port)" tests/scripts/two_rank_deepspeed.py "$RUN/$name" "$stage" main
}
if [ -z "${PLAN:-}" ]; then
  PLAN=""
  for stage in ${STAGES:-2 3}; do for scenario in ${SCENARIOS:-main restart}; do PLAN="$PLAN $stage:$scenario"; done; done
fi
for item in $PLAN; do
  stage="${item%%:*}" scenario="${item#*:}"
    case "$scenario" in
      main) timed "zero${stage}_main" "$N" "$RUN/zero${stage}_main" "$stage" main ;;
      restart) timed "zero${stage}_restart" "$N" "$RUN/zero${stage}_restart" "$stage" restart
               timed "zero${stage}_relaunch" "$N" "$RUN/zero${stage}_restart" "$stage" restart relaunch ;;
      one) timed "zero${stage}_one" 1 "$RUN/zero${stage}_one" "$stage" one ;;
      accelerate) launched "zero${stage}_accelerate" "$N" "$stage" ;;
      grpo) timed "zero${stage}_grpo" "$N" "$RUN/zero${stage}_grpo" "$stage" grpo ;;
    esac
done
"$PY" benchmarks/deepspeed_summary.py "$RUN" "$N"
