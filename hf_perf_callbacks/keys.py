"""Every name the package writes down: the metric keys the callbacks log (their units and meanings in
:data:`KEY_DOCS`, from which docs/keys.md is generated), the phases of a step, the prefixes of the callbacks' keys
and of the trainer's own values in a step line, and the files beside a run. One owner: every module and test
imports them from here (``runlog`` re-exports them: ``hf_perf_callbacks.core.runlog.PERF_MFU`` stays valid).

Pure: no torch, no transformers.
"""
from __future__ import annotations

PERF_LOG = "perf_log.jsonl"
GB = 1024**3                           # bytes per GB in every ``*_gb`` figure (GiB, 2³⁰ bytes)
SPLIT_FILE = "tuner_split.json"        # the tuner's split and decisions, beside the perf log
LOCK_FILE = ".hf_perf.lock"            # held by the process training into output_dir (the bus holds it)

#: the phases of a step's wall time (``perf/phase/<phase>``, ``perf/phase_sec/<phase>``, seconds on the step line;
#: meanings in :mod:`hf_perf_callbacks.core.timeline`): they sum to ``perf/step_wall_sec``, ``unexplained`` included
PHASES = ("data_wait", "generation", "rollout_wait", "reward", "compute", "eval", "save", "log", "own_callbacks",
          "user_callbacks", "recompute", "unexplained")
#: the phases a clock measures directly (a region entered and left); ``compute`` is the step's own time outside
#: them and ``unexplained`` the time outside a step that no clock measured
CLOCKED_PHASES = ("data_wait", "generation", "rollout_wait", "eval", "save", "log", "own_callbacks", "user_callbacks",
                  "compute")

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
PERF_CHILD_CPU_SEC = "perf/child_cpu_sec"
PERF_CPU_TIME_RATIO = "perf/cpu_time_ratio"
PERF_OTHER_CPU_CORES = "perf/other_cpu_cores"
PERF_LOAD_PER_CORE = "perf/load_per_core"
# ThroughputMeter, GRPO: TRL's generation entry (step lines only; every backend: HF generate, vLLM server, colocate)
PERF_GENERATION_BATCH = "perf/generation_batch"
PERF_COMPLETION_TOKENS = "perf/completion_tokens"
PERF_WEIGHT_SYNC_SEC = "perf/weight_sync_sec"
PERF_REWARD_SEC = "perf/reward_sec"
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
MEM_COMPLETION_WALL_TOKENS = "mem/completion_wall_tokens"
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
#: the callbacks' keys that the console's log line keeps (transformers' ``ProgressCallback``/``PrinterCallback``):
#: throughput, MFU, memory against the budget and the split in effect; every key still reaches ``log_history``, the
#: reporters (``report_to``) and the perf log
CONSOLE_KEYS = (PERF_TOKENS_PER_SEC, PERF_MFU, MEM_DEVICE_USED_GB, MEM_LIMIT_GB, TUNER_MICRO_BATCH, TUNER_GRAD_ACCUM)
#: the widest line the package prints on the console (a logging prefix such as ``WARNING hf_perf_callbacks: ``
#: included); the whole text of an event is in the perf log
CONSOLE_WIDTH = 160
#: the prefix of the trainer's own log values in a step line: ``TRAINER_LOG + "reward"`` is GRPO's ``reward``
TRAINER_LOG = "log/"

# ---------------------------------------------------------------- what each key means (docs/keys.md is generated)
#: where a key goes: to the trainer's logs (so the reporters, ``log_history`` and the step lines), or to the step
#: lines of ``perf_log.jsonl`` only
REPORTED, PERF_LOG_ONLY = "reporters and perf log", "perf log only"
#: key → (unit, meaning, where it goes). ``python -m hf_perf_callbacks.keys`` prints the table of docs/keys.md;
#: ``tests/test_docs.py`` checks that every metric key above has its row and that the page shows this table.
KEY_DOCS: dict[str, tuple[str, str, str]] = {
    PERF_TOKENS_PER_SEC: ("tok/s", "windowed (whole GRPO generation cycles), global", REPORTED),
    PERF_TOKENS_PER_SEC_PER_DEVICE: ("tok/s", "windowed, global / world size", REPORTED),
    PERF_STEADY_TOKENS_PER_SEC: ("tok/s", "after warmup only, eval and save excluded", REPORTED),
    PERF_STEADY_STEP_TIME: ("s", "mean training time of the steady steps", REPORTED),
    PERF_STEP_TIME: ("s", "mean training time per optimizer step in the window", REPORTED),
    PERF_WARMUP_DONE: ("0/1", "warmup has ended in this `train()` call", REPORTED),
    PERF_WARMUP_STEPS: ("steps", "steps before steady state", REPORTED),
    PERF_WARMUP_OVERHEAD_SEC: ("s", "time above the steady step time during warmup", REPORTED),
    PERF_FIRST_STEP_SLOWDOWN: ("ratio", "first step (GRPO: generation cycle) / steady step time", REPORTED),
    PERF_MFU: ("fraction", "model FLOPs utilisation: model FLOPs per token × tokens/s per device / peak (absent when "
                           "the peak is unknown)", REPORTED),
    PERF_HFU: ("fraction", "hardware FLOPs utilisation: MFU with activation recompute counted", REPORTED),
    PERF_ROLLOUT_TOKENS_PER_SEC: ("tok/s", "GRPO: completion tokens of every rank per second of engine time (the "
                                           "longest engine call of the step: the ranks' engines run at once, one "
                                           "server serving every rank counts once); not decode speed (a batch "
                                           "decodes until its longest completion)", REPORTED),
    PERF_TRAIN_TOKENS_PER_SEC: ("tok/s", "GRPO: tokens per second of the time outside generation and the wait for "
                                         "rollouts", REPORTED),
    PERF_GENERATION_BATCH: ("count", "GRPO: completions TRL generated in the step on this rank (0 on a step that "
                                     "trains buffered ones)", PERF_LOG_ONLY),
    PERF_COMPLETION_TOKENS: ("tokens", "GRPO: tokens of those completions (with tools: the model's own)",
                             PERF_LOG_ONLY),
    PERF_WEIGHT_SYNC_SEC: ("s", "GRPO with vLLM: time in the weight syncs to vLLM (`VLLMGeneration.sync_weights`; "
                                "async GRPO: `_sync_weight`), TRL's own work in them included (part of the generation "
                                "phase)", PERF_LOG_ONLY),
    PERF_REWARD_SEC: ("s", "GRPO: time in TRL's reward functions (the step's reward phase)", PERF_LOG_ONLY),
    PERF_CALLBACK_SEC: ("s", "`perf/callback_sec/<ClassName>`: the seconds of one of the user's callback classes' "
                             "events in the step (the user_callbacks phase by class), present when it spent any",
                        PERF_LOG_ONLY),
    PERF_DECODE_BANDWIDTH_UTIL: ("fraction", "GRPO: weight bytes read per decode step × steps / time / peak "
                                             "bandwidth", REPORTED),
    PERF_FORWARDS_PER_MICROBATCH: ("count", "grad-enabled forwards per micro-batch (more than 1 is flagged once)",
                                   REPORTED),
    PERF_PAD_FRACTION: ("fraction", "padding share of the positions in the step's training forwards", REPORTED),
    **{key: ("%", f"share of wall time in {phase} since the last log"
                  + (" (a generating trainer's: GRPO)" if phase == "generation" else ""), REPORTED)
       for phase, key in PERF_PHASE_SHARE.items()},
    **{key: ("s", f"the step's seconds in {phase}", PERF_LOG_ONLY) for phase, key in PERF_PHASE_SEC.items()},
    PERF_STEP_WALL_SEC: ("s", "the step's wall time", PERF_LOG_ONLY),
    PERF_TOKENS: ("tokens", "the step's tokens (global)", PERF_LOG_ONLY),
    PERF_SEQ_LEN: ("tokens", "the longest padded sequence of the step's training forwards", PERF_LOG_ONLY),
    PERF_TRAIN_SEC: ("s", "the step's training time (wall minus eval and save; the slowest rank's): what its "
                          "throughput is computed from", PERF_LOG_ONLY),
    PERF_STEADY: ("0/1", "1: the step was known to be steady when its line was written", PERF_LOG_ONLY),
    PERF_FIRST_STEADY_STEP: ("step", "this `train()` call's first steady step, on every line from the warmup "
                                     "decision on (a killed run's log still gives the steady steps exactly)",
                             PERF_LOG_ONLY),
    PERF_EARLY_CONTENTION_SEC: ("s", "the meter's contention figure so far: slow early steps' excess that no extra "
                                     "CPU time of the process explains", PERF_LOG_ONLY),
    PERF_CPU_SEC: ("s", "process CPU time (all threads; on a CPU device its child processes' too: inductor's compile "
                        "workers, DataLoader workers) over the same span as `perf/step_wall_sec`", PERF_LOG_ONLY),
    PERF_CHILD_CPU_SEC: ("s", "CPU device: the child processes' part of `perf/cpu_sec`", PERF_LOG_ONLY),
    PERF_CPU_TIME_RATIO: ("cores", "`perf/cpu_sec` / `perf/step_wall_sec`: threads this process kept busy",
                          PERF_LOG_ONLY),
    PERF_OTHER_CPU_CORES: ("cores", "busy cores of the machine during the step minus this process's",
                           PERF_LOG_ONLY),
    PERF_LOAD_PER_CORE: ("ratio", "1-minute load average / logical cores (where `os.getloadavg` exists)",
                         PERF_LOG_ONLY),
    MEM_DEVICE_USED_GB: ("GiB", "used: the allocator's peak in the step (CUDA), Metal's driver memory (MPS), the "
                                "process RSS (CPU)", REPORTED),
    MEM_ALLOCATED_GB: ("GiB", "live tensors at the step end", REPORTED),
    MEM_DRIVER_GB: ("GiB", "MPS driver memory / CUDA reserved", REPORTED),
    MEM_PEAK_GB: ("GiB", "high-water mark of used memory in this run", REPORTED),
    MEM_LIMIT_GB: ("GiB", "the budget of the step (the wall): it moves with what the run can reach", REPORTED),
    MEM_OUTSIDE_GB: ("GiB", "memory of the card (CUDA) or machine (MPS, CPU) outside this run's reach: other "
                            "processes, and memory this process holds outside PyTorch's allocator", REPORTED),
    MEM_SYSTEM_AVAILABLE_GB: ("GiB", "available RAM (macOS: inactive + free)", REPORTED),
    MEM_SWAP_USED_GB: ("GiB", "swap in use", REPORTED),
    MEM_PRESSURE: ("level", "0 ok, 1 warn, 2 critical", REPORTED),
    MEM_STEPS_TO_WALL: ("steps", "steps until the budget at the fitted growth; absent when memory is not growing or "
                                 "the wall lies beyond the run's last step", REPORTED),
    MEM_STEPS_TO_WALL_LOW: ("steps", "low end of its 95% range", REPORTED),
    MEM_STEPS_TO_WALL_HIGH: ("steps", "high end of its 95% range (capped at the steps left in the run)", REPORTED),
    MEM_GROWTH_MB_PER_STEP: ("MiB", "slope of the trend fit", REPORTED),
    MEM_COMPLETION_WALL_TOKENS: ("tokens", "GRPO: the completion length at which a step's peak reaches the budget "
                                           "(the peak fitted against each log's longest completion)", REPORTED),
    MEM_OS_PRESSURE: ("level", "macOS: the kernel's memory pressure level (1/2/4)", REPORTED),
    MEM_SWAPOUTS: ("count", "macOS: swap-outs since the last step", REPORTED),
    MEM_COMPRESSOR_GB: ("GiB", "macOS: compressor size", REPORTED),
    MEM_FOOTPRINT_GB: ("GiB", "macOS: the process's `phys_footprint`", REPORTED),
    MEM_ALLOC_RETRIES: ("count", "CUDA allocator retries since the last step", REPORTED),
    TUNER_MICRO_BATCH: ("samples", "per-device micro-batch now", REPORTED),
    TUNER_GRAD_ACCUM: ("steps", "gradient accumulation now", REPORTED),
    TUNER_EFFECTIVE_BATCH: ("samples", "micro-batch × accumulation × world (constant)", REPORTED),
    TUNER_RESIZES: ("count", "re-sizes so far", REPORTED),
    CACHE_CLEARS: ("count", "clears so far", REPORTED),
    CACHE_FREED_GB: ("GiB", "freed by clears since the last log", REPORTED),
    CACHE_SECONDS: ("s", "time spent clearing since the last log", REPORTED),
    CACHE_INTERVAL: ("steps", "current periodic interval", REPORTED),
}


def key_table() -> str:
    """The markdown table of docs/keys.md: one row per key of :data:`KEY_DOCS`, grouped by prefix."""
    rows = ["| key | unit | meaning | goes to |", "|---|---|---|---|"]
    for prefix in CALLBACK_PREFIXES:
        rows += [f"| `{key}` | {unit} | {meaning} | {where} |"
                 for key, (unit, meaning, where) in KEY_DOCS.items() if key.startswith(prefix)]
    return "\n".join(rows)


__all__ = [
    "PERF_LOG", "GB", "SPLIT_FILE", "LOCK_FILE", "PHASES", "CLOCKED_PHASES", "PERF_TOKENS_PER_SEC",
    "PERF_TOKENS_PER_SEC_PER_DEVICE", "PERF_STEADY_TOKENS_PER_SEC", "PERF_STEADY_STEP_TIME", "PERF_STEP_TIME",
    "PERF_WARMUP_DONE", "PERF_WARMUP_STEPS", "PERF_WARMUP_OVERHEAD_SEC", "PERF_FIRST_STEP_SLOWDOWN", "PERF_MFU",
    "PERF_HFU", "PERF_ROLLOUT_TOKENS_PER_SEC", "PERF_TRAIN_TOKENS_PER_SEC", "PERF_DECODE_BANDWIDTH_UTIL",
    "PERF_FORWARDS_PER_MICROBATCH", "PERF_PAD_FRACTION", "PERF_PHASE_SHARE", "PERF_PHASE_SEC", "PERF_STEP_WALL_SEC",
    "PERF_TOKENS", "PERF_SEQ_LEN", "PERF_TRAIN_SEC", "PERF_STEADY", "PERF_FIRST_STEADY_STEP",
    "PERF_EARLY_CONTENTION_SEC", "PERF_CPU_SEC", "PERF_CHILD_CPU_SEC", "PERF_CPU_TIME_RATIO", "PERF_OTHER_CPU_CORES",
    "PERF_LOAD_PER_CORE",
    "PERF_GENERATION_BATCH", "PERF_COMPLETION_TOKENS", "PERF_WEIGHT_SYNC_SEC", "PERF_REWARD_SEC",
    "PERF_CALLBACK_SEC", "MEM_DEVICE_USED_GB", "MEM_ALLOCATED_GB", "MEM_DRIVER_GB", "MEM_PEAK_GB", "MEM_LIMIT_GB",
    "MEM_OUTSIDE_GB", "MEM_SYSTEM_AVAILABLE_GB", "MEM_SWAP_USED_GB", "MEM_PRESSURE", "MEM_STEPS_TO_WALL",
    "MEM_STEPS_TO_WALL_LOW", "MEM_STEPS_TO_WALL_HIGH", "MEM_GROWTH_MB_PER_STEP", "MEM_COMPLETION_WALL_TOKENS",
    "MEM_OS_PRESSURE", "MEM_SWAPOUTS", "MEM_COMPRESSOR_GB", "MEM_FOOTPRINT_GB", "MEM_ALLOC_RETRIES",
    "TUNER_MICRO_BATCH", "TUNER_GRAD_ACCUM", "TUNER_EFFECTIVE_BATCH", "TUNER_RESIZES", "CACHE_CLEARS",
    "CACHE_FREED_GB", "CACHE_SECONDS", "CACHE_INTERVAL", "CALLBACK_PREFIXES", "CONSOLE_KEYS", "CONSOLE_WIDTH",
    "TRAINER_LOG", "REPORTED", "PERF_LOG_ONLY", "KEY_DOCS", "key_table"
]


if __name__ == "__main__":
    print(key_table())
