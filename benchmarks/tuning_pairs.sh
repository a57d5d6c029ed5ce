#!/usr/bin/env bash
# The tuning's cost on one 2-GPU host, each start in its own pair: the tuned run from the start on GPU 0 beside a plain
# run of the best split (32×1) on GPU 1, at the same time (bench_tuner.py --part sequential, one start a call).
#   RES=/tmp/hfres PAIRS="2x16:500 4x8:250 32x1:250" setsid nohup bash benchmarks/tuning_pairs.sh > /tmp/hfres.log 2>&1 &
# Each pair's result, tuner_sequential_<card>_<start>_<steps>steps.json, goes to $RES (copy it to benchmarks/results); its
# log to $RES/<start>.log; $RES/progress says when each began and ended. ARGS: more flags for every pair, e.g. on a host
# of one GPU, both runs of a pair on its card, the same callbacks on both sides (a 450-step pair takes 9-11 minutes on
# one H200, 1.15-1.3 s a step each: at or past one device call's 10; start it so and collect it in the next call):
#   ARGS="--one-card --no-watchdog" PAIRS="2x16:450" setsid nohup bash benchmarks/tuning_pairs.sh > /tmp/hfres.log 2>&1 &
set -u
RES=${RES:-/tmp/hfres}
mkdir -p "$RES"
cd "$(dirname "$0")"
export HF_PERF_RESULTS="$RES" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for pair in ${PAIRS:-2x16:500 4x8:250 32x1:250}; do
    start=${pair%%:*} steps=${pair#*:}
    echo "start $start $steps $(date +%s)" >> "$RES/progress"
    python3 bench_tuner.py --part sequential --starts "${start%x*}" "${start#*x}" --steps "$steps" \
        --completion "${COMPLETION:-16}" --timeout $(( steps * 2 + 120 )) ${ARGS:-} > "$RES/$start.log" 2>&1
    echo "end $start $? $(date +%s)" >> "$RES/progress"
done
echo "all done $(date +%s)" >> "$RES/progress"
