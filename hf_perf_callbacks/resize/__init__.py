"""Re-sizing a run: the fastest exact (micro-batch, accumulation) split that fits, the effective batch kept exact.

=================  ==========================================================================================
module             job
=================  ==========================================================================================
``callback``       :class:`AdaptiveBatchTuner`: observes the run, records the split and every decision
``loop``           :func:`train_with_tuning`: the checkpoint → resume loop, OOM recovery, checkpoint choice
``probe``          the pre-flight probe: a few real steps per exact split at the worst-case length
``agreement``      cross-rank agreement on OOMs inside a training step (:class:`ResizeNeeded`, :class:`PeerFailed`)
``sharding``       what works under FSDP (re-size by checkpoint) and DeepSpeed (refused), said at start
=================  ==========================================================================================
"""
from .agreement import PeerFailed, ResizeNeeded
from .callback import SPLIT_FILE, AdaptiveBatchTuner, apply_split, current_split, saved_split
from .loop import train_with_tuning

__all__ = ["AdaptiveBatchTuner", "train_with_tuning", "PeerFailed", "ResizeNeeded", "SPLIT_FILE", "saved_split",
           "apply_split", "current_split"]
