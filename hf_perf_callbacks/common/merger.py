"""The callbacks' metrics merged into the next training log, before any reporter sees it.

``Trainer.log`` copies ``logs`` into ``state.log_history`` and then calls ``on_log`` on the callbacks in order; the
reporters (TensorBoard, W&B, trackio, MLflow…) come before user callbacks, so keys a user callback adds in ``on_log``
reach neither the reporters nor ``log_history``. The callbacks publish into one :class:`MetricsMerger` per trainer (held
by the :class:`~hf_perf_callbacks.common.bus.RunBus`, first in the callback list) during ``on_step_end``; it merges
everything into the next training log *before* any reporter runs, and into ``log_history[-1]``. Only training logs get
the metrics (:func:`is_training_log`): not an evaluation's log, not the end-of-training summary.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = ["MetricsMerger", "is_training_log", "END_OF_TRAINING_KEYS", "finite"]


class MetricsMerger:
    """Metrics published for the next training log (later values of a key replace earlier ones)."""

    def __init__(self) -> None:
        self.unlogged: dict[str, float] = {}       # metrics for the next training log

    def publish(self, metrics: Mapping[str, float | None]) -> None:
        """Metrics for the next training log (None and values that are not finite numbers are left out)."""
        self.unlogged.update({k: v for k, v in metrics.items() if finite(v)})

    def withdraw(self, *keys: str) -> None:
        """Take metrics back from the next training log (a value that no longer holds, e.g. a stale forecast)."""
        for key in keys:
            self.unlogged.pop(key, None)

    def merge(self, logs: dict[str, Any], state: Any) -> None:
        """Merge the published metrics into the training log ``logs`` and into ``state.log_history``'s entry of
        this step; the next log starts empty."""
        if not self.unlogged:
            return
        logs.update(self.unlogged)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.unlogged)
        self.unlogged = {}


#: the keys only the end-of-training log carries all of (transformers 5.23-5.24 ``Trainer._finalize_training``:
#: ``speed_metrics("train", ...)``, ``total_flos``, ``train_loss``)
END_OF_TRAINING_KEYS = frozenset({"train_runtime", "total_flos", "train_loss"})


def is_training_log(logs: Mapping[str, Any]) -> bool:
    """A log of training steps (``Trainer._maybe_log_save_evaluate``), not an evaluation's or the end-of-training
    summary.

    * An evaluation log (``Trainer.evaluate``/``predict``; TRL's trainers add their evaluation metrics to it) holds
      ``<prefix>_runtime`` for its metric prefix (``eval``, ``eval_<dataset>``, ``test``, any ``metric_key_prefix``)
      or keys starting with ``eval_`` or ``test_``.
    * The end-of-training summary holds every key of :data:`END_OF_TRAINING_KEYS`.
    * A training log may hold ``train_runtime`` and ``train_tokens_per_second``: transformers adds them to every log
      while ``include_num_input_tokens_seen`` is on, so neither key alone tells a summary.
    """
    if END_OF_TRAINING_KEYS <= logs.keys():
        return False
    return not any(k.startswith(("eval_", "test_")) or (k.endswith("_runtime") and k != "train_runtime")
                   for k in logs)


def finite(value: object) -> TypeGuard[float]:
    """A number that is finite (not a bool, not NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
