#!/usr/bin/env bash
# What the package costs a step once the tuning has decided, on a 4-GPU host: four runs of --steps at 32×1 at once,
# one a GPU: plain; plain with a MemoryWatchdog; tuned from 32×1 with the watchdog (as bench_tuner --part sequential);
# tuned without it. Each run's tuner_run_probe_<name>.json goes to the results folder (and $OUT).
set -u
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
steps=${STEPS:-200}
run() { CUDA_VISIBLE_DEVICES=$1 python3 bench_tuner.py --part run --split 32 1 --steps "$steps" --completion 16 \
            --label "probe_$2" "${@:3}" > "/tmp/probe_$2.log" 2>&1; echo "$2 exit $?"; }
run 0 plain --mode plain &
run 1 plain_watchdog --mode plain --watchdog &
run 2 tuned --mode tuned &
run 3 tuned_no_watchdog --mode tuned --no-watchdog &
wait
tail -n 4 /tmp/probe_*.log
