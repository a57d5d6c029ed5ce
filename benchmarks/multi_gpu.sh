#!/usr/bin/env bash
# Every GPU of one host (written for four), and two nodes simulated on one host: the FSDP2 path of issue 21 in one GPU session.
#   bash benchmarks/multi_gpu.sh           # every GPU of the host (4: multi_gpu_*.json; N other than 4:
#                                          # multi_gpu_<N>gpu_*.json, NGPU=N to choose); at most 220 + 60 + 180 s
#                                          # (the launches' timeouts), inside 8 minutes on 4 H100s
#   bash benchmarks/multi_gpu.sh --smoke   # the same on CPU processes (gloo, the tests' tiny model):
#                                          # multi_gpu_smoke_*.json; NPROC ranks on one host (default 2), NPROC_NODE
#                                          # per simulated node (default 1)
# Results also go to $OUT when set; HF_PERF_RESULTS moves the results folder. Needs torch, transformers, accelerate,
# peft, and TRL and datasets (install the carried wheels first: pip install --no-index --find-links DIR trl datasets).
#  1. FSDP2 on N GPUs (accelerate launch, fsdp.yaml, --num_processes N): the callbacks' figures global and equal on
#     every rank, the perf log written once; a watchdog re-size on the last rank (sharded checkpoint, the same split
#     recorded on every rank, then a relaunch reaching max_steps); a watchdog stop on the last rank stopping all.
#  2. an OOM inside the last rank's step: refused under FSDP, the launch must end at once with the message.
#  3. two nodes on one host: two torchrun launchers (--nnodes 2 --node_rank 0/1 --nproc_per_node N/2, the first
#     and the second half of the GPUs, rendezvous on localhost), FSDP2 from TrainingArguments: figures global, the
#     perf log written once per job, the re-size decided alike on all ranks (planted on the last rank, on node 1).
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
  NODE_GPUS=("" ""); TIMEOUTS=(600 180 600)          # a loaded 2-core CPU
else
  # every GPU of the host (NGPU overrides; an even number >= 2): half of them per simulated node
  N="${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}"
  if [ "$N" -lt 2 ] || [ $(( N % 2 )) -ne 0 ]; then echo "multi_gpu.sh needs an even number of GPUs >= 2, got $N" >&2; exit 2; fi
  PER_NODE=$(( N / 2 )); FLAG=(); PREFIX=multi_gpu
  [ "$N" -ne 4 ] && PREFIX="multi_gpu_${N}gpu"
  LAUNCH=(accelerate launch --config_file hf_perf_callbacks/recipes/accelerate/fsdp.yaml --num_processes "$N"
          --main_process_port "$(free_port)")
  NODE_GPUS=("$(seq -s, 0 $(( PER_NODE - 1 )))" "$(seq -s, "$PER_NODE" $(( N - 1 )))")
  TIMEOUTS=(220 60 180)                              # at most 460 s of the 8 minutes
fi
started=$(date +%s)

echo "== 1. FSDP2 on $N ranks of one host: figures, a watchdog re-size by relaunch, a stop"
HF_PERF_BENCH_DIR="$RUN/one_host" timeout "${TIMEOUTS[0]}" "${LAUNCH[@]}" benchmarks/bench_fsdp.py "${FLAG[@]}" \
  --name "${PREFIX}_fsdp" 2>&1 | quiet
echo "== 2. an OOM inside the last rank's step under FSDP: refused, the launch ends at once"
t0=$(date +%s)
HF_PERF_BENCH_DIR="$RUN/oom" timeout "${TIMEOUTS[1]}" "${LAUNCH[@]}" benchmarks/bench_fsdp.py oom "${FLAG[@]}" \
  --name "${PREFIX}_fsdp" > "$RUN/oom.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - t0 ))
said=$(grep -c "out of memory under FSDP: not recoverable in lockstep" "$RUN/oom.log")
echo "exit code $rc (non-zero expected, 124 = hung until the timeout) after ${elapsed} s; message printed ${said} time(s)"
"$PY" - "$rc" "$elapsed" "$said" "${PREFIX}_fsdp_oom" <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
from common import RESULTS, write_result
rc, elapsed, said, name = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
path = os.path.join(RESULTS, f"{name}.json")
rank = json.load(open(path)) if os.path.exists(path) else {}           # what the planted rank wrote before raising
write_result(name, {"planted_rank_record": {k: rank.get(k) for k in ("rank", "reraised", "step", "seconds_to_raise")},
                    "launch_exit_code": rc, "launch_seconds": elapsed, "hung": rc == 124,
                    "message_printed": said > 0, "ended_at_once": rc not in (0, 124) and said > 0})
PY
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
echo "== done in $(( $(date +%s) - started )) s; results: ${PREFIX}_fsdp.json, ${PREFIX}_fsdp_oom.json," \
     "${PREFIX}_two_nodes.json in ${HF_PERF_RESULTS:-benchmarks/results}"
