#!/usr/bin/env bash
# The tuning's GPU measurements in one background sequence on one GPU: the tuned and plain 300-step runs first,
# then the meter's accuracy, the sweep and the switch costs. Results (JSON) and logs go to $RES.
#   RES=/tmp/hfres setsid nohup bash benchmarks/gpu_tuning.sh > /tmp/hfres.log 2>&1 &
set -u
RES=${RES:-/tmp/hfres}
STEPS=${STEPS:-300}
COMPLETION=${COMPLETION:-16}
mkdir -p "$RES"
cd "$(dirname "$0")"
run() {
    local name=$1; shift
    echo "start $name $(date +%s)" >> "$RES/progress"
    OUT=$RES PYTHONUNBUFFERED=1 python "$@" > "$RES/$name.log" 2>&1
    echo "end $name $? $(date +%s)" >> "$RES/progress"
}
common=(--completion "$COMPLETION")
run tuned_4x8 bench_tuner.py --part run --mode tuned --split 4 8 --steps "$STEPS" "${common[@]}"
run plain_32x1 bench_tuner.py --part run --mode plain --split 32 1 --steps "$STEPS" "${common[@]}"
run tuned_32x1 bench_tuner.py --part run --mode tuned --split 32 1 --steps "$STEPS" "${common[@]}"
run accuracy bench_accuracy.py
run sweep bench_tuner.py --part sweep --steps 10 "${common[@]}" --splits 4 8 --splits 8 4 --splits 16 2
run switch bench_tuner.py --part switch --split 4 8 --steps 12 "${common[@]}"
echo "all done $(date +%s)" >> "$RES/progress"
