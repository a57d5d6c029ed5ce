"""An out-of-memory error in evaluation never changes the training split: the evaluation batch is halved and the
evaluation retried (the RNG put back first), at batch 1 skipped with one warning, or — where the run needs the
metric (``metric_for_best_model``, a plateau scheduler) — the run ends (saved first by the loop).

**The same eval_loss.** transformers' ``eval_loss`` is the mean over the evaluation's rows of each batch's mean loss,
so a smaller batch gives another figure (per-batch means weigh rows by their batch's label tokens). Where the loss
is the library's mean over label tokens, the halved evaluation gives back the configured batch's figure exactly: each
configured batch is now ``factor`` consecutive smaller ones, and the last of each group reports the loss that
makes the group's rows sum to the configured batch's token-weighted mean (:class:`_ConfiguredLoss`). Elsewhere (a
loss of the user's, an evaluation set that does not fill its last configured batch) the warning says that
``eval_loss`` is the smaller batch's from that evaluation on.

Under several ranks an OOM in evaluation is raised as it is (the other ranks are inside a collective).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..platform import adapter
from ..platform.device import is_oom_error, rng_state, set_rng_state, world_size
from .release import free_memory

if TYPE_CHECKING:
    from transformers import Trainer


def evaluate_within_memory(trainer: Trainer, original: Callable[..., dict[str, float]],
                           warn_once: Callable[[str, str], object], grpo: bool) -> Callable[..., dict[str, float]]:
    """``trainer.evaluate`` that halves its batch on an out-of-memory error (see the module docstring); ``grpo``:
    the trainer is GRPO's (its evaluation batch stays whole groups of completions)."""
    configured = trainer.args.per_device_eval_batch_size

    def evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
        targs = trainer.args
        while True:
            drawn = rng_state()          # a new evaluation dataloader iterator draws from the global RNG
            batch = targs.per_device_eval_batch_size
            exact = _ConfiguredLoss(trainer, configured, batch) if batch < configured and not grpo else None
            try:
                return original(*args, **kwargs)
            except Exception as error:
                if world_size() > 1 or not is_oom_error(error):
                    raise
                error = error.with_traceback(None)
                set_rng_state(drawn)     # the retry draws what the failed attempt drew: the run's stream goes on
                smaller = _smaller_eval_batch(targs, batch, grpo)
                free_memory(trainer, warn_once)
                if smaller is not None:
                    targs.per_device_eval_batch_size = smaller
                    same = ("eval_loss stays the configured batch's" if not grpo and _ConfiguredLoss.applies(
                        trainer, configured, smaller) else
                            f"eval_loss is the mean of batches of {smaller} from now on, not of {configured}: a loss "
                            f"of the user's, or an evaluation set that does not fill its last batch")
                    warn_once(f"eval-{smaller}", f"evaluation ran out of memory at per_device_eval_batch_size="
                                                 f"{batch}: retrying with {smaller} ({same}); the training split is "
                                                 f"unchanged")
                    continue
                scheduler = str(getattr(targs, "lr_scheduler_type", ""))
                if getattr(targs, "metric_for_best_model", None) or "plateau" in scheduler or "greedy" in scheduler:
                    raise RuntimeError(f"evaluation does not fit even at per_device_eval_batch_size={batch} and "
                                       f"the run needs its metric (metric_for_best_model="
                                       f"{targs.metric_for_best_model!r}, lr_scheduler_type={scheduler}): lower the "
                                       f"evaluation's memory (shorter eval sequences, eval_accumulation_steps)"
                                       ) from error
                warn_once("eval-skip", f"evaluation ran out of memory even at per_device_eval_batch_size={batch}: "
                                       f"evaluations are skipped for this run; training goes on at its split")
                return {}
            finally:
                if exact is not None:
                    exact.undo()

    return evaluate


class _ConfiguredLoss:
    """While a halved evaluation runs: each group of ``factor`` consecutive batches reports, in its last batch, the
    loss that makes the group's share of ``eval_loss`` the configured batch's (the token-weighted mean of its
    batches' losses, each a mean over its label tokens)."""

    def __init__(self, trainer: Trainer, configured: int, batch: int) -> None:
        self.trainer, self.factor = trainer, configured // batch
        self.parts: list[tuple[float, int]] = []
        self.undo: Callable[[], None] = lambda: None
        if self.applies(trainer, configured, batch):
            self.undo = adapter.replace_method(trainer, "prediction_step", self._wrap)

    @staticmethod
    def applies(trainer: Trainer, configured: int, batch: int) -> bool:
        """The loss is the library's mean over label tokens (a causal LM's through ``Trainer.compute_loss``), and
        the evaluation set fills whole configured batches, each now whole smaller ones."""
        from transformers import Trainer as Library

        dataset: Any = trainer.eval_dataset            # the user's evaluation set: any object, sized or not
        rows = len(dataset) if hasattr(dataset, "__len__") and not isinstance(dataset, dict) else None
        return (configured % batch == 0 and rows is not None and rows % (configured * world_size()) == 0
                and type(trainer).compute_loss is Library.compute_loss and trainer.compute_loss_func is None)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prediction_step(model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            loss, logits, labels = original(model, inputs, *args, **kwargs)
            targets = inputs.get("labels") if isinstance(inputs, Mapping) else None
            if loss is None or not isinstance(targets, torch.Tensor):
                return loss, logits, labels
            counted = targets[..., 1:] if adapter.loss_shifts_labels(self.trainer) else targets
            self.parts.append((float(loss), int((counted != -100).sum())))
            if len(self.parts) < self.factor:
                return loss, logits, labels
            tokens = sum(t for _, t in self.parts)
            mean = sum(v * t for v, t in self.parts) / tokens if tokens else 0.0
            last = self.factor * mean - sum(v for v, _ in self.parts[:-1])
            self.parts = []
            return torch.full_like(loss, last), logits, labels
        return prediction_step


def _smaller_eval_batch(args: Any, batch: int, grpo: bool) -> int | None:
    """Half the evaluation batch (GRPO: still whole groups of ``num_generations_eval`` completions), or None."""
    if grpo:
        group = getattr(args, "num_generations_eval", None) or args.num_generations
        for smaller in range(batch // 2, 0, -1):
            if (smaller * world_size()) % group == 0:
                return smaller
        return None
    return int(batch // 2) if batch > 1 else None
