"""Where an out-of-memory error struck, and whether a smaller micro-batch can fix it.

A re-size changes the micro-batch and the accumulation; some memory does not depend on them. An OOM there is
recognised from the error's traceback (the frames it passed through, outermost first) and ends the run with no
re-size, naming the cause and the setting that does fix it:

======================  =============================================  ============================================
site (frames)           why the micro-batch does not matter            what fixes it
======================  =============================================  ============================================
a reward function       TRL scores the whole generation batch in one   that function (named); a smaller generation
(``reward_funcs``)      call                                           batch
generation (frames of   GRPO generates the whole generation batch of   ``generation_batch_size`` /
``transformers.         a rank at once; it stays fixed by design when  ``steps_per_generation``,
generation``, TRL's     the tuner re-sizes                             ``max_completion_length``, vLLM
vLLM generation, vLLM)
======================  =============================================  ============================================

An OOM while the :class:`~hf_perf_callbacks.MemoryWatchdog` knows of a leak (memory that grew on every step of its
trend window) is not re-sized either (:func:`leak_message`): a smaller micro-batch does not stop a leak, and every
smaller split would run out of memory again.

The outermost match wins: a reward function that calls ``generate`` itself (a judge model) is named as the reward
function. Every other OOM (the training forward and backward, GRPO's scoring forwards, which run in micro-batches)
is the micro-batch's. A site is an integer so that ranks can agree on it in one exchange: :data:`MICRO_BATCH`,
:data:`GENERATION`, or :data:`REWARD` + the reward function's index.
"""
from __future__ import annotations

import traceback
from types import FrameType
from typing import TYPE_CHECKING, cast

from ..core.memory import mib
from ..platform.device import error_chain, error_line, world_size

if TYPE_CHECKING:
    from transformers import Trainer

    from ..core.memory import WallFacts

MICRO_BATCH, GENERATION, REWARD = 0, 1, 2

#: modules whose frames are generation: transformers' ``generate`` (and continuous batching), TRL's vLLM
#: generation, vLLM itself
GENERATION_MODULES = ("transformers.generation", "trl.generation", "vllm")


class UnfixableOOM(RuntimeError):
    """An out-of-memory error that no smaller micro-batch fixes (see :mod:`~hf_perf_callbacks.resize.oomsite`)."""


def oom_site(error: BaseException, trainer: Trainer) -> int:
    """The site of ``error`` (an out-of-memory error) in ``trainer``'s step: see the module docstring."""
    rewards = list(getattr(trainer, "reward_funcs", None) or [])
    for current in error_chain(error):
        for frame, _ in traceback.walk_tb(current.__traceback__):
            for index, func in enumerate(rewards):
                if _runs(frame, func):
                    return REWARD + index
            if str(frame.f_globals.get("__name__", "")).startswith(GENERATION_MODULES):
                return GENERATION
    return MICRO_BATCH


def _runs(frame: FrameType, func: object) -> bool:
    """Whether ``frame`` is a call of the reward function ``func``: a function (or a partial of one), or a callable
    object or reward model (a frame of one of its methods)."""
    inner = getattr(func, "func", func)                      # functools.partial
    code = getattr(inner, "__code__", None)
    return frame.f_code is code if code is not None else frame.f_locals.get("self") is inner


def unfixable_cause(error: BaseException, trainer: Trainer, site: int | None = None,
                    facts: WallFacts | None = None) -> str | None:
    """Why no smaller micro-batch fixes this out-of-memory error, or None: it struck in generation or a reward
    function (``site``: where, as the ranks agreed; None: read from the error's traceback), or in one process while
    the watchdog knows of a leak (``facts``: its :class:`~hf_perf_callbacks.core.memory.WallFacts`)."""
    cause = unfixable_message(oom_site(error, trainer) if site is None else site, trainer, error)
    if cause is None and world_size() == 1:
        cause = leak_message(facts, error)
    return cause


def unfixable_message(site: int, trainer: Trainer, error: BaseException) -> str | None:
    """What ran out of memory and what fixes it, for a site no smaller micro-batch fixes (None for the micro-batch)."""
    args = trainer.args
    generation = getattr(args, "generation_batch_size", None)
    batch = f"the whole generation batch ({generation} completions per rank)" if generation else "the whole batch"
    if site == GENERATION:
        return (f"out of memory in generation ({error_line(error)[:120]}), which a smaller micro-batch cannot fix: "
                f"GRPO generates {batch} at once, and the tuner keeps it fixed. Lower generation_batch_size (or "
                f"steps_per_generation) or max_completion_length={getattr(args, 'max_completion_length', None)}, or "
                f"generate with vLLM (use_vllm=True)")
    if site >= REWARD:
        names = list(getattr(trainer, "reward_func_names", None) or [])
        index = site - REWARD
        name = names[index] if index < len(names) else f"reward_funcs[{index}]"
        return (f"out of memory in the reward function {name!r} ({error_line(error)[:120]}), which a smaller "
                f"micro-batch cannot fix: TRL scores {batch} in one call. Make {name!r} use less memory (score in "
                f"chunks, keep no large tensors), or lower generation_batch_size")
    return None


def leak_message(facts: WallFacts | None, error: BaseException) -> str | None:
    """The cause of an out-of-memory error while the watchdog knows of a leak (``facts``: its
    :class:`~hf_perf_callbacks.core.memory.WallFacts`), naming what else holds memory; None without a known leak."""
    leak = getattr(facts, "leak_per_step", None)
    if not leak:
        return None
    others = cast("WallFacts", facts).outside_words()             # not None: it has a leak
    return (f"out of memory ({error_line(error)[:120]}) while memory grew by {mib(leak)} on every step: a leak, which "
            f"a smaller micro-batch cannot fix (each smaller split would run out of memory again). Fix the leak: "
            f"tensors kept across steps (a loss appended without .item(), a growing cache)"
            + (f"; also, {others}" if others else ""))
