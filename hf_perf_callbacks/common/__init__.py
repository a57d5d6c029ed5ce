"""What the callbacks share: the visible shell (base.py), the RunBus and its parts (metrics into the training log,
perf_log.jsonl, the console, one process per output_dir, typed requests, one cross-rank exchange per step)."""
