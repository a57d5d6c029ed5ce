"""The logged metric names users' dashboards, queries and alerts depend on, each written out once: renaming a key
must fail here, deliberately (every other test names keys through :mod:`hf_perf_callbacks.keys`)."""
from hf_perf_callbacks import keys

LOGGED = {
    "CACHE_CLEARS": "cache/clears",
    "CACHE_FREED_GB": "cache/freed_gb",
    "CACHE_INTERVAL": "cache/interval",
    "CACHE_SECONDS": "cache/seconds",
    "MEM_ALLOCATED_GB": "mem/allocated_gb",
    "MEM_ALLOC_RETRIES": "mem/alloc_retries",
    "MEM_COMPRESSOR_GB": "mem/compressor_gb",
    "MEM_DEVICE_USED_GB": "mem/device_used_gb",
    "MEM_DRIVER_GB": "mem/driver_gb",
    "MEM_FOOTPRINT_GB": "mem/footprint_gb",
    "MEM_COMPLETION_WALL_TOKENS": "mem/completion_wall_tokens",
    "MEM_GROWTH_MB_PER_STEP": "mem/growth_mb_per_step",
    "MEM_LIMIT_GB": "mem/limit_gb",
    "MEM_OS_PRESSURE": "mem/os_pressure",
    "MEM_OUTSIDE_GB": "mem/outside_gb",
    "MEM_PEAK_GB": "mem/peak_gb",
    "MEM_PRESSURE": "mem/pressure",
    "MEM_STEPS_TO_WALL": "mem/steps_to_wall",
    "MEM_STEPS_TO_WALL_HIGH": "mem/steps_to_wall_high",
    "MEM_STEPS_TO_WALL_LOW": "mem/steps_to_wall_low",
    "MEM_SWAPOUTS": "mem/swapouts",
    "MEM_SWAP_USED_GB": "mem/swap_used_gb",
    "MEM_SYSTEM_AVAILABLE_GB": "mem/system_available_gb",
    "PERF_CALLBACK_SEC": "perf/callback_sec/",
    "PERF_CPU_SEC": "perf/cpu_sec",
    "PERF_CHILD_CPU_SEC": "perf/child_cpu_sec",
    "PERF_COMPLETION_TOKENS": "perf/completion_tokens",
    "PERF_CPU_TIME_RATIO": "perf/cpu_time_ratio",
    "PERF_DECODE_BANDWIDTH_UTIL": "perf/decode_bandwidth_util",
    "PERF_EARLY_CONTENTION_SEC": "perf/early_contention_sec",
    "PERF_FIRST_STEADY_STEP": "perf/first_steady_step",
    "PERF_FIRST_STEP_SLOWDOWN": "perf/first_step_slowdown",
    "PERF_FORWARDS_PER_MICROBATCH": "perf/forwards_per_microbatch",
    "PERF_GENERATION_BATCH": "perf/generation_batch",
    "PERF_HFU": "perf/hfu",
    "PERF_LOAD_PER_CORE": "perf/load_per_core",
    "PERF_MFU": "perf/mfu",
    "PERF_OTHER_CPU_CORES": "perf/other_cpu_cores",
    "PERF_PAD_FRACTION": "perf/pad_fraction",
    "PERF_REWARD_SEC": "perf/reward_sec",
    "PERF_ROLLOUT_TOKENS_PER_SEC": "perf/rollout_tokens_per_sec",
    "PERF_SEQ_LEN": "perf/seq_len",
    "PERF_STEADY": "perf/steady",
    "PERF_STEADY_STEP_TIME": "perf/steady_step_time",
    "PERF_STEADY_TOKENS_PER_SEC": "perf/steady_tokens_per_sec",
    "PERF_STEP_TIME": "perf/step_time",
    "PERF_STEP_WALL_SEC": "perf/step_wall_sec",
    "PERF_TOKENS": "perf/tokens",
    "PERF_TOKENS_PER_SEC": "perf/tokens_per_sec",
    "PERF_TOKENS_PER_SEC_PER_DEVICE": "perf/tokens_per_sec_per_device",
    "PERF_TRAIN_SEC": "perf/train_sec",
    "PERF_TRAIN_TOKENS_PER_SEC": "perf/train_tokens_per_sec",
    "PERF_WARMUP_DONE": "perf/warmup_done",
    "PERF_WARMUP_OVERHEAD_SEC": "perf/warmup_overhead_sec",
    "PERF_WARMUP_STEPS": "perf/warmup_steps",
    "PERF_WEIGHT_SYNC_SEC": "perf/weight_sync_sec",
    "TUNER_EFFECTIVE_BATCH": "tuner/effective_batch",
    "TUNER_GRAD_ACCUM": "tuner/grad_accum",
    "TUNER_MICRO_BATCH": "tuner/micro_batch",
    "TUNER_RESIZES": "tuner/resizes",
}


def test_the_logged_names_stay():
    assert {name: getattr(keys, name) for name in LOGGED} == LOGGED


def test_the_phase_keys_follow_the_phases():
    assert keys.PHASES == ("data_wait", "generation", "rollout_wait", "reward", "compute", "eval", "save", "log",
                           "own_callbacks", "user_callbacks", "recompute", "unexplained")
    assert keys.PERF_PHASE_SHARE == {p: f"perf/phase/{p}" for p in keys.PHASES}
    assert keys.PERF_PHASE_SEC == {p: f"perf/phase_sec/{p}" for p in keys.PHASES}


def test_every_metric_key_is_listed_here():
    named = {name for name in dir(keys) if name.isupper() and isinstance(getattr(keys, name), str)
             and getattr(keys, name).startswith(keys.CALLBACK_PREFIXES)}
    assert named == set(LOGGED)
