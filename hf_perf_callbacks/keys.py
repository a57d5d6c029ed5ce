"""Every name the package writes down: the metric keys the callbacks log (their units and meanings are in each
callback's docstring and the README), the phases of a step, the prefixes of the callbacks' keys and of the
trainer's own values in a step line, and the files beside a run. One owner: every module and test imports them from
here (``runlog`` re-exports them: ``hf_perf_callbacks.runlog.PERF_MFU`` stays valid).

Pure: no torch, no transformers.
"""
from __future__ import annotations

PERF_LOG = "perf_log.jsonl"
GB = 1024**3                           # bytes per GB in every ``*_gb`` figure (GiB, 2³⁰ bytes)
SPLIT_FILE = "tuner_split.json"        # the tuner's split and decisions, beside the perf log
LOCK_FILE = ".hf_perf.lock"            # held by the process training into output_dir (the bus holds it)
TRAINER_STATE = "trainer_state.json"

#: the phases of a step's wall time (``perf/phase/<phase>``, ``perf/phase_sec/<phase>``, seconds on the step line;
#: meanings in :mod:`hf_perf_callbacks.timeline`): they sum to ``perf/step_wall_sec``, ``unexplained`` included
PHASES = ("data_wait", "generation", "compute", "eval", "save", "log", "own_callbacks", "user_callbacks", "recompute",
          "unexplained")
#: the phases a clock measures directly (a region entered and left); ``compute`` is the step's own time outside
#: them and ``unexplained`` the time outside a step that no clock measured
CLOCKED_PHASES = ("data_wait", "eval", "save", "log", "own_callbacks", "user_callbacks", "compute")

# ---------------------------------------------------------------- metric keys (the callbacks document their units)
# ThroughputMeter: published to the reporters and written to the step lines
PERF_TOKENS_PER_SEC = "perf/tokens_per_sec"
PERF_TOKENS_PER_SEC_PER_DEVICE = "perf/tokens_per_sec_per_device"
PERF_STEADY_TOKENS_PER_SEC = "perf/steady_tokens_per_sec"
PERF_STEADY_STEP_TIME = "perf/steady_step_time"
PERF_STEP_TIME = "perf/step_time"
PERF_WARMUP_DONE = "perf/warmup_done"
PERF_WARMUP_STEPS = "perf/warmup_steps"
PERF_WARMUP_OVERHEAD_SEC = "perf/warmup_overhead_sec"
PERF_FIRST_STEP_SLOWDOWN = "perf/first_step_slowdown"
PERF_MFU = "perf/mfu"
PERF_HFU = "perf/hfu"
PERF_ROLLOUT_TOKENS_PER_SEC = "perf/rollout_tokens_per_sec"
PERF_TRAIN_TOKENS_PER_SEC = "perf/train_tokens_per_sec"
PERF_DECODE_BANDWIDTH_UTIL = "perf/decode_bandwidth_util"
PERF_FORWARDS_PER_MICROBATCH = "perf/forwards_per_microbatch"
PERF_PAD_FRACTION = "perf/pad_fraction"
#: share of wall time per phase since the last log (published at logging steps)
PERF_PHASE_SHARE = {p: f"perf/phase/{p}" for p in PHASES}
# ThroughputMeter: step lines only
PERF_PHASE_SEC = {p: f"perf/phase_sec/{p}" for p in PHASES}
PERF_STEP_WALL_SEC = "perf/step_wall_sec"
PERF_TOKENS = "perf/tokens"
PERF_SEQ_LEN = "perf/seq_len"
PERF_TRAIN_SEC = "perf/train_sec"
PERF_STEADY = "perf/steady"
PERF_FIRST_STEADY_STEP = "perf/first_steady_step"
PERF_EARLY_CONTENTION_SEC = "perf/early_contention_sec"
PERF_CPU_SEC = "perf/cpu_sec"
PERF_CPU_TIME_RATIO = "perf/cpu_time_ratio"
PERF_OTHER_CPU_CORES = "perf/other_cpu_cores"
PERF_LOAD_PER_CORE = "perf/load_per_core"
#: seconds of one of the user's callback classes in the step (``perf/callback_sec/<ClassName>``, s): every event of
#: the class timed through the trainer's callback handler (the package's own callbacks are the ``own_callbacks``
#: phase, transformers', TRL's and the reporters' the ``log`` phase)
PERF_CALLBACK_SEC = "perf/callback_sec/"
# MemoryWatchdog
MEM_DEVICE_USED_GB = "mem/device_used_gb"
MEM_ALLOCATED_GB = "mem/allocated_gb"
MEM_DRIVER_GB = "mem/driver_gb"
MEM_PEAK_GB = "mem/peak_gb"
MEM_LIMIT_GB = "mem/limit_gb"
MEM_OUTSIDE_GB = "mem/outside_gb"
MEM_SYSTEM_AVAILABLE_GB = "mem/system_available_gb"
MEM_SWAP_USED_GB = "mem/swap_used_gb"
MEM_PRESSURE = "mem/pressure"
MEM_STEPS_TO_WALL = "mem/steps_to_wall"
MEM_STEPS_TO_WALL_LOW = "mem/steps_to_wall_low"
MEM_STEPS_TO_WALL_HIGH = "mem/steps_to_wall_high"
MEM_GROWTH_MB_PER_STEP = "mem/growth_mb_per_step"
MEM_OS_PRESSURE = "mem/os_pressure"
MEM_SWAPOUTS = "mem/swapouts"
MEM_COMPRESSOR_GB = "mem/compressor_gb"
MEM_FOOTPRINT_GB = "mem/footprint_gb"
MEM_ALLOC_RETRIES = "mem/alloc_retries"
# AdaptiveBatchTuner
TUNER_MICRO_BATCH = "tuner/micro_batch"
TUNER_GRAD_ACCUM = "tuner/grad_accum"
TUNER_EFFECTIVE_BATCH = "tuner/effective_batch"
TUNER_RESIZES = "tuner/resizes"
# MPSCacheClearer
CACHE_CLEARS = "cache/clears"
CACHE_FREED_GB = "cache/freed_gb"
CACHE_SECONDS = "cache/seconds"
CACHE_INTERVAL = "cache/interval"
#: the prefixes of the callbacks' own keys above
CALLBACK_PREFIXES = ("perf/", "mem/", "tuner/", "cache/")
#: the prefix of the trainer's own log values in a step line: ``TRAINER_LOG + "reward"`` is GRPO's ``reward``
TRAINER_LOG = "log/"
