#!/usr/bin/env bash
# Every GPU of one host (written for four), and two nodes simulated on one host: the FSDP2 path end to end.
#   bash benchmarks/multi_gpu.sh           # every GPU of the host (4: multi_gpu_*.json; N other than 4:
#                                          # multi_gpu_<N>gpu_*.json, NGPU=N to choose); at most 370 + 200 + 120 s
#                                          # (the launches' timeouts; run SECTIONS apart inside 10 minutes)
#   bash benchmarks/multi_gpu.sh --smoke   # the same on CPU processes (gloo, the tests' tiny model):
#                                          # multi_gpu_smoke_*.json; NPROC ranks on one host (default 2), NPROC_NODE
#                                          # per simulated node (default 1)
# Results also go to $OUT when set; HF_PERF_RESULTS moves the results folder. Needs torch, transformers, accelerate,
# peft, and TRL and datasets (install the carried wheels first: pip install --no-index --find-links DIR trl datasets).
#  1. FSDP2 on N GPUs (accelerate launch, fsdp.yaml, --num_processes N): the callbacks' figures global and equal on
#     every rank, the perf log written once; a watchdog re-size on the last rank (sharded checkpoint, the same split
#     on every rank, on to max_steps in the same process); OOMs planted inside one rank's step (forward, backward;
#     full fine-tune and LoRA) recovered in the same process on every rank, the unfaulted run's samples trained;
#     the step guard's cost per step (on, and off once stable); a watchdog stop on the last rank stopping all.
#  2. an OOM after the step guard came off ends the launch with the smaller split recorded; the relaunch (RESTARTS=N:
#     the launcher's own --max_restarts N instead) resumes every rank from the newest checkpoint with it, to
#     max_steps.
#  3. two nodes on one host: two torchrun launchers (--nnodes 2 --node_rank 0/1 --nproc_per_node N/2, the first
#     and the second half of the GPUs, rendezvous on localhost), FSDP2 from TrainingArguments: figures global, the
#     perf log written once per job, the re-size decided alike on all ranks (planted on the last rank, on node 1).
# SECTIONS="1 2 3" (default) chooses the sections; SCENARIOS (section 1's, comma-separated) the scenarios.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
PY="${PYTHON:-python3}"
"$PY" -c "import torch, transformers, accelerate, peft, trl, datasets" || {
  echo "multi_gpu.sh needs torch, transformers, accelerate, peft, trl and datasets importable by $PY" >&2; exit 2; }
RUN="/tmp/hf_perf_multi_gpu/$$"
mkdir -p "$RUN"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
quiet() { grep -v -E "Warning|warnings.warn|^\{|^ *warnings\." ; }
if [ "${1:-}" = "--smoke" ]; then
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
  N="${NPROC:-2}"; PER_NODE="${NPROC_NODE:-1}"; FLAG=(--smoke); PREFIX=multi_gpu_smoke
  LAUNCH=("$PY" -m torch.distributed.run --nproc_per_node "$N" --master_port "$(free_port)")
  RESTARTING=("$PY" -m torch.distributed.run --nproc_per_node "$N" --max-restarts "${RESTARTS:-0}"
              --rdzv-backend c10d --rdzv-endpoint "localhost:$(free_port)")
  NODE_GPUS=("" ""); TIMEOUTS=(1200 600 600)         # a loaded 2-core CPU
else
  # every GPU of the host (NGPU overrides; an even number >= 2): half of them per simulated node
  N="${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}"
  if [ "$N" -lt 2 ] || [ $(( N % 2 )) -ne 0 ]; then echo "multi_gpu.sh needs an even number of GPUs >= 2, got $N" >&2; exit 2; fi
  PER_NODE=$(( N / 2 )); FLAG=(); PREFIX=multi_gpu
  [ "$N" -ne 4 ] && PREFIX="multi_gpu_${N}gpu"
  LAUNCH=(accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes "$N"
          --main_process_port "$(free_port)")
  RESTARTING=("${LAUNCH[@]}" --max_restarts "${RESTARTS:-0}" --rdzv_backend c10d)
  NODE_GPUS=("$(seq -s, 0 $(( PER_NODE - 1 )))" "$(seq -s, "$PER_NODE" $(( N - 1 )))")
  TIMEOUTS=(${T1:-370} ${T2:-200} ${T3:-120})       # SECTIONS="1 2 3": at most 690 s (T1, T2, T3 override)
fi
started=$(date +%s)

SECTIONS="${SECTIONS:-1 2 3}"
if [[ " $SECTIONS " == *" 1 "* ]]; then
echo "== 1. FSDP2 on $N ranks of one host: figures, re-sizes and OOMs recovered in process, the guard's cost, a stop"
HF_PERF_BENCH_DIR="$RUN/one_host" timeout "${TIMEOUTS[0]}" "${LAUNCH[@]}" benchmarks/bench_fsdp.py "${FLAG[@]}" \
  --scenarios "${SCENARIOS:-throughput,resize,recover,lora,guard,stop}" --name "${PREFIX}_fsdp" 2>&1 | quiet
fi
if [[ " $SECTIONS " == *" 2 "* ]]; then
echo "== 2. an OOM after the step guard came off: the split recorded, the next attempt resumes with it"
t0=$(date +%s)
HF_PERF_BENCH_DIR="$RUN/restart" timeout "${TIMEOUTS[1]}" "${RESTARTING[@]}" benchmarks/bench_fsdp.py restart \
  "${FLAG[@]}" --name "${PREFIX}_fsdp" > "$RUN/restart.log" 2>&1
rc=$?
echo "first launch: exit code $rc after $(( $(date +%s) - t0 )) s (RESTARTS=${RESTARTS:-0})"
if [ "${RESTARTS:-0}" = 0 ]; then
  HF_PERF_BENCH_DIR="$RUN/restart" timeout "${TIMEOUTS[1]}" "${LAUNCH[@]}" benchmarks/bench_fsdp.py restart \
    --relaunch "${FLAG[@]}" --name "${PREFIX}_fsdp" >> "$RUN/restart.log" 2>&1
  echo "relaunch: exit code $? after $(( $(date +%s) - t0 )) s (0 expected: it reached max_steps)"
fi
grep -E "\[tuner\] (out of memory under FSDP|restarted by the launcher)" "$RUN/restart.log" | cut -c1-200 | sort -u
fi
if [[ " $SECTIONS " != *" 3 "* ]]; then
  echo "== done in $(( $(date +%s) - started )) s"; exit 0
fi
echo "== 3. two nodes simulated on one host: 2 launchers × $PER_NODE ranks, rendezvous on localhost"
port=$(free_port)
for node in 0 1; do
  CUDA_VISIBLE_DEVICES="${NODE_GPUS[$node]}" HF_PERF_BENCH_DIR="$RUN/two_nodes" timeout "${TIMEOUTS[2]}" \
    "$PY" -m torch.distributed.run --nnodes 2 --node_rank "$node" --nproc_per_node "$PER_NODE" \
    --master_addr 127.0.0.1 --master_port "$port" benchmarks/bench_fsdp.py "${FLAG[@]}" --fsdp_args \
    --scenarios throughput,resize --name "${PREFIX}_two_nodes" > "$RUN/node$node.log" 2>&1 &
done
wait
quiet < "$RUN/node0.log" | tail -25
for node in 0 1; do
  grep -q "Traceback" "$RUN/node$node.log" && { echo "node $node failed:"; tail -30 "$RUN/node$node.log"; }
done
echo "== done in $(( $(date +%s) - started )) s; results: ${PREFIX}_fsdp.json, ${PREFIX}_fsdp_restart.json," \
     "${PREFIX}_two_nodes.json in ${HF_PERF_RESULTS:-benchmarks/results}"
