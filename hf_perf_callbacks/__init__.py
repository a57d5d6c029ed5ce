"""Hugging Face ``TrainerCallback``s that measure true training speed and keep runs from dying of memory.

```python
from hf_perf_callbacks import default_callbacks, train_with_tuning
trainer = GRPOTrainer(..., callbacks=default_callbacks())
train_with_tuning(trainer)          # or trainer.train(): everything but live re-sizing still works
```

The callbacks are imported on first use (module ``__getattr__``), so ``hf-perf --help`` and the pure modules
(``runlog``, ``report``, ``stats``…) load without torch or transformers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name → the module that defines it (the callbacks, the loop, and the errors a caller may catch)
_LAZY = {"ThroughputMeter": ".throughput", "MemoryWatchdog": ".watchdog", "MPSCacheClearer": ".cache",
         "AdaptiveBatchTuner": ".resize", "train_with_tuning": ".resize",
         "UnfixableOOM": ".resize", "InexactResize": ".resize", "PeerFailed": ".resize",
         "OutputDirBusy": ".common.outputdir", "ReportError": ".core.runlog"}

if TYPE_CHECKING:                      # what the lazy names are, for type checkers and editors
    from transformers import TrainerCallback

    from .cache import MPSCacheClearer
    from .common.outputdir import OutputDirBusy
    from .core.runlog import ReportError
    from .resize import AdaptiveBatchTuner, InexactResize, PeerFailed, UnfixableOOM, train_with_tuning
    from .throughput import ThroughputMeter
    from .watchdog import MemoryWatchdog


#: the package's callbacks: what :func:`default_callbacks` builds, in this order (the recipe launcher's default too)
CALLBACKS = ("ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner")


def __getattr__(name: str) -> Any:                     # the lazy names' types: the TYPE_CHECKING imports above
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def default_callbacks(**overrides: dict[str, Any]) -> list[TrainerCallback]:
    """The package's callbacks, configured for the detected device (the cache clearer acts on MPS only).

    ``overrides`` maps a callback class name to its keyword arguments, e.g.
    ``default_callbacks(ThroughputMeter={"window_steps": 20})``.
    """
    classes = {name: __getattr__(name) for name in CALLBACKS}
    unknown = set(overrides) - set(classes)
    if unknown:
        from .core.validation import did_you_mean

        first = sorted(unknown)[0]
        raise ValueError(f"default_callbacks got unknown callback name(s) {sorted(unknown)}"
                         f"{did_you_mean(first, classes)}: allowed are {sorted(classes)}")
    for name, kwargs in overrides.items():
        if not isinstance(kwargs, dict):
            raise ValueError(f"default_callbacks({name}={kwargs!r}) is not allowed: expected a dict of that "
                             f"callback's keyword arguments")
    from .core.wording import BUILT_BY_DEFAULT_CALLBACKS

    built = [cls(**overrides.get(name, {})) for name, cls in classes.items()]
    for callback in built:                      # a hint to change an argument is worded as default_callbacks(...)
        callback.built_by = BUILT_BY_DEFAULT_CALLBACKS   # the package's own mark
    return built


__all__ = ["ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner", "default_callbacks",
           "train_with_tuning", "UnfixableOOM", "InexactResize", "PeerFailed", "OutputDirBusy", "ReportError",
           "__version__"]
