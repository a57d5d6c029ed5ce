"""Re-sizing a run: the fastest exact (micro-batch, accumulation) split that fits, the effective batch kept exact.

=================  ==========================================================================================
module             job
=================  ==========================================================================================
``session``        :class:`TuningSession`: the one owner of the split, the decisions, the checkpoints this run
                   wrote and the session id; the only writer of ``tuner_split.json``
``tuning``         the tuning on the run's own steps: which split to try next, when it pays back (pure)
``callback``       :class:`AdaptiveBatchTuner`: measures the steps, logs the split, answers the watchdog
``loop``           :func:`train_with_tuning`: the switch / re-size loop, OOM recovery, checkpoint choice
``memcheck``       one step at the worst-case length before training, where memory is tight (CUDA, MPS)
``grouping``       the facts that decide whether the run's loss depends on how examples are grouped into
                   micro-batches, read once at the start (the rule over them: ``batching.exact_under``)
``agreement``      cross-rank agreement on OOMs inside a training step (:class:`ResizeNeeded`, :class:`PeerFailed`)
``oomsite``        where an OOM struck: an OOM no smaller micro-batch fixes (generation, a reward function) ends the
                   run named, with its fix (:class:`UnfixableOOM`), instead of a re-size
``sharding``       what works under FSDP and DeepSpeed (re-size by checkpoint; DeepSpeed: a new engine)
``checkpoints``    which checkpoints a run may resume from: complete ones; partial and stale ones moved aside
=================  ==========================================================================================

The split file's schema and its one reader are :mod:`hf_perf_callbacks.splitfile` (pure, for the report).
"""
from .agreement import PeerFailed, ResizeNeeded
from .callback import AdaptiveBatchTuner
from .loop import train_with_tuning
from .oomsite import UnfixableOOM
from .session import InexactResize, TuningSession, current_split

__all__ = ["AdaptiveBatchTuner", "train_with_tuning", "InexactResize", "PeerFailed", "ResizeNeeded", "TuningSession",
           "UnfixableOOM", "current_split"]
