"""Re-sizing a run: the fastest exact (micro-batch, accumulation) split that fits, the effective batch kept exact.

=================  ==========================================================================================
module             job
=================  ==========================================================================================
``record``         :class:`SplitRecord`: the split facts, decisions and checks of a run, and the one writer of
                   ``tuner_split.json`` (pure: no trainer, no torch)
``plan``           the decisions as pure transitions: a split state in, a plan out
``executor``       :class:`Executor`: the trainer side; carries every change out (snapshot → plan → stage →
                   check → commit once) and owns the checkpoints, the loop's state and the change watch
``watch``          what a change is checked on: the old and new split's fetches of the step it starts with
``exactness``      the check of a change on that step's rows: gradients grouped both ways, compared
``tuning``         the tuning on the run's own steps: which split to try next, when it pays back (pure)
``callback``       :class:`AdaptiveBatchTuner`: measures the steps, logs the split, answers the watchdog
``loop``           :func:`train_with_tuning`: the switch / re-size loop
``evaluation``     an evaluation OOM halves the evaluation batch, never the training split
``memcheck``       one step at the worst-case length before training, where memory is tight (CUDA, MPS)
``grouping``       the facts the settings list reads (the rule over them: ``batching.exact_under``)
``agreement``      cross-rank agreement on OOMs inside a training step (:class:`ResizeNeeded`, :class:`PeerFailed`)
``oomsite``        where an OOM struck: an OOM no smaller micro-batch fixes ends the run named (:class:`UnfixableOOM`)
``sharding``       what works under FSDP and DeepSpeed (re-size by checkpoint; DeepSpeed: a new engine)
``checkpoints``    which checkpoints a run may resume from: complete ones; partial and stale ones moved aside
``release``        the memory a failed step holds, given back
=================  ==========================================================================================

The split file's schema and its one reader are :mod:`hf_perf_callbacks.core.splitfile` (pure, for the report).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name → the module that defines it, imported on first use (the pure record and plan load without torch)
_LAZY = {"AdaptiveBatchTuner": ".callback", "train_with_tuning": ".loop", "InexactResize": ".plan",
         "PeerFailed": ".agreement", "ResizeNeeded": ".agreement", "Executor": ".executor",
         "UnfixableOOM": ".oomsite", "current_split": "..core.batching"}

if TYPE_CHECKING:
    from ..core.batching import current_split
    from .agreement import PeerFailed, ResizeNeeded
    from .callback import AdaptiveBatchTuner
    from .executor import Executor
    from .loop import train_with_tuning
    from .oomsite import UnfixableOOM
    from .plan import InexactResize


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdaptiveBatchTuner", "train_with_tuning", "InexactResize", "PeerFailed", "ResizeNeeded", "Executor",
           "UnfixableOOM", "current_split"]
