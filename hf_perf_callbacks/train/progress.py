"""Signs of life for the launcher's slow steps: on a CPU a GRPO step takes minutes, and a progress bar at ``0/2``
says nothing meanwhile. :class:`StepPulse` says, on the main process and above the progress bar:

- when training begins: what the first step does (completions to generate, micro-batches to train), and that it is
  the slowest;
- in a slow step (the first, or one after a step of over :data:`PULSE_SEC`): ``step 1: generating …`` when a
  generation begins, its completions, tokens and seconds when it ends;
- when a micro-batch ends :data:`PULSE_SEC` after the last line: which one of how many, and the step's time so far;
  after the first micro-batch of a slow step, the time the whole step takes at that pace (when that is over
  :data:`PULSE_SEC`).

A fast step (a GPU's) prints nothing but the first line. Generations are seen through TRL's own entry point
(:func:`hf_perf_callbacks.platform.adapter.watch_generation_entry`), micro-batches through ``on_substep_end`` and
``on_step_end``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ..platform import adapter

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

#: seconds after which a step is slow enough to be told as it goes (and between two of its lines)
PULSE_SEC = 20.0


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def first_step_line(args: Any, world: int = 1) -> str:       # a GRPOConfig (or any TrainingArguments)
    """The line said when training begins (see the module docstring), from the run's arguments."""
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    micro = int(getattr(args, "per_device_train_batch_size", 1) or 1)
    length = getattr(args, "max_completion_length", None)
    work = f"trains {accumulation} micro-batch{'es' * (accumulation != 1)} of {micro}"
    if length is not None and getattr(args, "num_generations", None):
        spg = int(getattr(args, "steps_per_generation", None) or accumulation)
        rounds = math.ceil(accumulation / spg)
        times = f" {rounds} times" if rounds > 1 else ""
        where = " on each process" if world > 1 else ""
        work = f"generates {micro * spg} completions (≤ {length} tokens){times}{where}, then {work}"
    return f"step 1 {work}: the slowest step (warm-up); a step over {PULSE_SEC:.0f} s says how it goes"


class StepPulse(TrainerCallback):
    """The launcher's lines of a slow step (see the module docstring); ``say`` prints one line above the progress
    bar, ``clock`` gives seconds."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 every: float = PULSE_SEC):
        self.say, self.clock, self.every = say, clock, every
        self.main = True
        self.step = 0                      # the step running now (global_step + 1)
        self.micro_batches = 1
        self.started = 0.0                 # when the step running now began
        self.said = 0.0                    # when the last line was said
        self.slow = True                   # whether this step is told as it goes: the first, or after a slow one
        self.done = 0                      # micro-batches of this step done
        self.generation_started: float | None = None
        self.generated: float | None = None   # when this step's generation ended
        self.estimated = False
        self._stop_watching: Callable[[], None] = lambda: None

    def watch(self, trainer: Trainer) -> None:
        """See ``trainer``'s generations (TRL's entry point), until :meth:`stop`."""
        self._stop_watching = adapter.watch_generation_entry(trainer, self)

    def stop(self) -> None:
        self._stop_watching()

    # ------------------------------------------------------------ the trainer's events
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.main = state.is_world_process_zero
        self.micro_batches = max(1, int(args.gradient_accumulation_steps))
        self._begin(state.global_step)
        if self.main and state.global_step == 0:
            self.say(first_step_line(args, args.world_size))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self.micro_batches = max(1, int(args.gradient_accumulation_steps))     # a re-size changes it

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._micro_batch_done()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._micro_batch_done()
        self.slow = self.clock() - self.started >= self.every
        self._begin(state.global_step)

    # ------------------------------------------------------------ TRL's generation entry (adapter's listener)
    def entry_started(self, kind: str) -> None:
        if kind != adapter.ROLLOUT:
            return
        self.generation_started = self.clock()
        if self.slow:
            self._say(f"step {self.step}: generating …")

    def entry_finished(self, kind: str, result: Any) -> None:
        if kind != adapter.ROLLOUT or self.generation_started is None:
            return
        self.generated = self.clock()
        took, self.generation_started = self.generated - self.generation_started, None
        if self.slow or took >= self.every:
            completions, tokens, _ = adapter.rollout_counts(kind, result)
            what = f"{completions} completions, {tokens} tokens" if completions else "done"
            self._say(f"step {self.step}: generated {what} in {duration(took)}")

    # ------------------------------------------------------------ steps
    def _begin(self, global_step: int) -> None:
        self.step, self.done, self.estimated, self.generated = global_step + 1, 0, False, None
        self.started = self.said = self.clock()

    def _micro_batch_done(self) -> None:
        self.done += 1
        now = self.clock()
        elapsed = now - self.started
        if self.done >= self.micro_batches or not (self.slow or elapsed >= self.every):
            return
        pace = now - (self.generated or self.started)           # the micro-batch's own time, its generation apart
        estimate = elapsed + pace * (self.micro_batches - self.done)
        if not self.estimated and self.done == 1 and estimate >= self.every:
            self.estimated = True
            self._say(f"step {self.step}: micro-batch 1 of {self.micro_batches} done at {duration(elapsed)}; "
                      f"at this pace the step takes about {duration(estimate)}")
        elif now - self.said >= self.every:
            self._say(f"step {self.step}: micro-batch {self.done} of {self.micro_batches} done at "
                      f"{duration(elapsed)}")

    def _say(self, text: str) -> None:
        self.said = self.clock()
        if self.main:
            self.say(text)
