"""What each holder of DeepSpeed's split says (the tests' check that a re-size reached all of them)."""
from __future__ import annotations

from typing import Any

from hf_perf_callbacks.platform.device import world_size
from hf_perf_callbacks.resize.sharding import DEEPSPEED_SPLIT_KEYS, deepspeed_plugin


def deepspeed_sizes(trainer: Any) -> dict[str, list[int]]:
    """What each holder of DeepSpeed's split says, ``[micro-batch, accumulation, train batch]`` (the engine's from
    its public getters); they must all agree with ``trainer.args``."""
    plugin = deepspeed_plugin(trainer)
    if plugin is None:
        return {}
    args = trainer.args
    sizes = {"args": [args.per_device_train_batch_size, args.gradient_accumulation_steps,
                      args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()],
             "plugin": [plugin.deepspeed_config.get(k) for k in DEEPSPEED_SPLIT_KEYS]}
    hf_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(hf_config, dict):
        sizes["hf_deepspeed_config"] = [hf_config.get(k) for k in DEEPSPEED_SPLIT_KEYS]
    engine: Any = getattr(trainer, "model_wrapped", None)     # DeepSpeedEngine's getters, duck-typed
    if engine is not None and hasattr(engine, "train_micro_batch_size_per_gpu"):
        sizes["engine"] = [engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                           engine.train_batch_size()]
    return sizes
