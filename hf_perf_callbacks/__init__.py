"""Hugging Face ``TrainerCallback``s that measure true training speed and keep runs from dying of memory.

```python
from hf_perf_callbacks import default_callbacks, train_with_tuning
trainer = GRPOTrainer(..., callbacks=default_callbacks())
train_with_tuning(trainer)          # or trainer.train(): everything but live re-sizing still works
```
"""
from .cache import MPSCacheClearer
from .throughput import ThroughputMeter
from .resize import AdaptiveBatchTuner, train_with_tuning
from .watchdog import MemoryWatchdog

__version__ = "0.1.0"


def default_callbacks(**overrides) -> list:
    """The package's callbacks, configured for the detected device (the cache clearer acts on MPS only).

    ``overrides`` maps a callback class name to its keyword arguments, e.g.
    ``default_callbacks(ThroughputMeter={"window_steps": 20})``.
    """
    classes = {"ThroughputMeter": ThroughputMeter, "MemoryWatchdog": MemoryWatchdog,
               "MPSCacheClearer": MPSCacheClearer, "AdaptiveBatchTuner": AdaptiveBatchTuner}
    unknown = set(overrides) - set(classes)
    if unknown:
        raise ValueError(f"default_callbacks got unknown callback name(s) {sorted(unknown)}: "
                         f"allowed are {sorted(classes)}")
    for name, kwargs in overrides.items():
        if not isinstance(kwargs, dict):
            raise ValueError(f"default_callbacks({name}={kwargs!r}) is not allowed: expected a dict of that "
                             f"callback's keyword arguments")
    return [cls(**overrides.get(name, {})) for name, cls in classes.items()]


__all__ = ["ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner", "default_callbacks",
           "train_with_tuning", "__version__"]
