"""AdaptiveBatchTuner: the callback side of re-sizing. It observes the run, records the split and every decision,
and answers the watchdog's request for a smaller micro-batch; :mod:`~hf_perf_callbacks.resize.loop` acts on them.

The split, every decision and the steps whose checkpoint this run wrote and verified (``written``, with the run's
``session`` id) are kept in ``<output_dir>/tuner_split.json`` and the checkpoint's callback state, so a resumed run
starts at the tuned split with its whole history — also when transformers rebuilds the callback from the checkpoint
(``restore_callback_states_from_checkpoint``): the rebuilt instance takes over the live one's newer history. Without
``train_with_tuning`` a re-size request saves, stops cleanly and prints the split and the command to resume with.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
import weakref
from dataclasses import asdict

from .. import adapter
from .. import runlog as keys
from ..base import Clock, PerfCallback
from ..batching import Split, exact_splits, next_smaller
from ..device import is_main_process, world_size
from ..bus import SIGNAL_SMALLER_BATCH
from ..validation import check_flag, check_number
from .checkpoints import checkpoint_dir, is_complete
from .splitfile import SPLIT_FILE, read_record

logger = logging.getLogger("hf_perf_callbacks")

#: the tuner that train_with_tuning manages, per trainer args (id → weak reference): a tuner instance that
#: transformers rebuilds from a checkpoint (restore_callback_states_from_checkpoint) takes its history over
_LIVE: dict[int, weakref.ref] = {}


def current_split(args) -> Split:
    spg = getattr(args, "steps_per_generation", None)
    return Split(args.per_device_train_batch_size, args.gradient_accumulation_steps, spg)


def apply_split(trainer, split: Split) -> None:
    """Set a split on a trainer's args in place (GRPO reads these live; the dataloader is rebuilt by train())."""
    args = trainer.args
    args.per_device_train_batch_size = split.micro_batch
    args.gradient_accumulation_steps = split.grad_accum
    if split.steps_per_generation is not None:
        args.steps_per_generation = split.steps_per_generation
        args.generation_batch_size = split.generation_batch(world_size())
    adapter.set_train_batch_size(trainer)


def saved_split(output_dir: str) -> dict | None:
    """The split recorded by a tuner that re-sized an earlier run in ``output_dir`` (None when there is none)."""
    record = read_record(output_dir)
    split = record.get("split") if record else None
    return split if isinstance(split, dict) else None


def hand_over(args, tuner) -> None:
    """Make ``tuner`` the live record of the run driven with ``args`` (see :data:`_LIVE`)."""
    for key in [k for k, ref in _LIVE.items() if ref() is None]:
        del _LIVE[key]
    _LIVE[id(args)] = weakref.ref(tuner)


def _live_tuner(args):
    ref = _LIVE.get(id(args))
    tuner = ref() if ref is not None else None
    return tuner if tuner is not None and tuner.run_args is args else None


class AdaptiveBatchTuner(PerfCallback):
    """Keeps the fastest exact micro-batch / accumulation split that fits (see :mod:`hf_perf_callbacks.resize`).

    Args:
        probe: run the pre-flight probe in :func:`train_with_tuning` (a fresh run only).
        probe_steps: measured steps per split, one per interleaved round (each split's first visit adds a
            warm-up step); fewer when the rest of the run cannot pay for them (see :mod:`.probe`).
        max_micro_batch: largest micro-batch the probe tries (None: up to the whole effective batch per rank).
        probe_patience: stop trying smaller splits once this many in a row were slower than the configured one.
        probe_must_pay: probe only as much as the rest of the run can pay back (False: every split, all rounds).
        rank_by: ``"non_generation"`` (step time minus generation time) or ``"step"`` (whole step time).

    Logged keys:

    =========================  =======  ==================================================
    key                        unit     meaning
    =========================  =======  ==================================================
    ``tuner/micro_batch``      samples  per-device micro-batch now
    ``tuner/grad_accum``       steps    gradient accumulation now
    ``tuner/effective_batch``  samples  micro-batch × accumulation × world (constant)
    ``tuner/resizes``          count    re-sizes so far
    =========================  =======  ==================================================
    """

    source = "tuner"

    def __init__(self, probe: bool = True, probe_steps: int = 4, max_micro_batch: int | None = None,
                 probe_patience: int = 1, rank_by: str = "non_generation", probe_must_pay: bool = True,
                 clock: Clock | None = None):
        check_flag("probe", probe)
        if rank_by not in ("step", "non_generation"):
            raise ValueError(f"rank_by={rank_by!r} is not allowed: expected 'step' or 'non_generation'")
        check_number("probe_steps", probe_steps, low=1, integer=True)
        check_number("max_micro_batch", max_micro_batch, low=1, integer=True, allow_none=True)
        check_number("probe_patience", probe_patience, low=1, integer=True)
        check_flag("probe_must_pay", probe_must_pay)
        super().__init__(clock)
        self.probe, self.probe_steps, self.max_micro_batch = probe, probe_steps, max_micro_batch
        self.probe_patience, self.rank_by, self.probe_must_pay = probe_patience, rank_by, probe_must_pay
        self.decisions: list[dict] = []
        self.split: Split | None = None
        self.planned_resize: dict | None = None
        self.managed = False             # train_with_tuning acts on planned re-sizes
        self.in_optimizer_step = False
        self.run_args = None
        self.session = uuid.uuid4().hex[:12]   # this run; kept across in-process re-sizes and every kind of resume
        self.written: list[int] = []           # steps whose checkpoint this run wrote and verified complete
        self.warned: set[str] = set()
        self.limits: str | None = None         # what does not work under the trainer's sharding (resize.sharding)

    # ------------------------------------------------------------ geometry
    def candidates(self, args) -> list[Split]:
        world = world_size()
        split = current_split(args)
        if hasattr(args, "num_generations"):
            return exact_splits(split.effective_batch(world), world, split.generation_batch(world),
                                args.num_generations)
        return exact_splits(split.effective_batch(world), world)

    # ------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        live = _live_tuner(args)
        if live is not None and live is not self:      # rebuilt from the checkpoint: the live history is newer
            self.adopt(live.decisions, live.session, live.written)
            self.managed, self.warned = live.managed, set(live.warned)
            hand_over(args, self)
        self.run_args = args
        if getattr(args, "auto_find_batch_size", False):
            self.warn("auto_find_batch_size=True re-sizes by itself (restarting at step 0 with a drifting batch): the "
                      "tuner stays off. Turn auto_find_batch_size off to let the tuner keep the batch exact.")
            self.disabled = True
            return
        self.split = current_split(args)
        self.world = world_size()
        self.bus.subscribe(SIGNAL_SMALLER_BATCH, self._on_smaller_batch)
        self.planned_resize = None
        self.in_optimizer_step = False
        if self.limits:                                  # see resize.sharding
            self.warn_once("sharding-limits", self.limits, step=state.global_step)
        for decision in self.decisions:          # the probe ran before any trainer event: log it now, once
            if decision["kind"] == "probe" and not decision.get("logged"):
                decision["logged"] = True
                # the probe printed its evidence once; the event names the outcome (details in tuner_split.json)
                self.bus.event(self.source, "decision", f"probe: {fmt_split(decision['old'])} → "
                               f"{fmt_split(decision['new'])} in {decision.get('probe_sec', 0.0):.1f} s",
                               step=0, old_split=decision["old"], new_split=decision["new"],
                               expected_gain_sec=decision.get("expected_gain_sec"))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.in_optimizer_step = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.in_optimizer_step = False

    def on_save(self, args, state, control, **kwargs):
        """transformers wrote checkpoint-N (on_save follows a whole _save_checkpoint): this run's, if complete."""
        self.record_written(args.output_dir, state.global_step)

    def record_written(self, output_dir: str, step: int) -> bool:
        """Record ``checkpoint-<step>`` as this run's when it is complete (checked by the main process, which
        writes it; the other ranks may see the files late and take its word). True when recorded."""
        if is_main_process() and not is_complete(checkpoint_dir(output_dir, step), step):
            return False
        if step not in self.written:
            self.written.append(step)
            self.persist()
        return True

    def on_step_end(self, args, state, control, **kwargs):
        if self.decisions and "recovery_sec" not in self.decisions[-1] and "resized_at" in self.decisions[-1]:
            self.decisions[-1]["recovery_sec"] = time.time() - self.decisions[-1]["resized_at"]
        s = current_split(args)                          # the split this step ran with (a decision applies later)
        fields = {keys.TUNER_MICRO_BATCH: s.micro_batch, keys.TUNER_GRAD_ACCUM: s.grad_accum,
                  keys.TUNER_EFFECTIVE_BATCH: s.effective_batch(self.world),
                  keys.TUNER_RESIZES: sum(d["kind"] != "probe" for d in self.decisions)}
        self.bus.record_step(state.global_step, fields)
        self.bus.publish(fields)

    def _on_smaller_batch(self, reason: str, step: int, control=None, **_) -> bool:
        """The watchdog asks for a smaller micro-batch: plan it, checkpoint now and stop this train() call."""
        if self.planned_resize is not None or control is None:
            return self.planned_resize is not None
        try:
            new = next_smaller(self.split, self.candidates(self.run_args))
        except ValueError:
            return False                                 # nothing smaller: the watchdog stops instead
        self.planned_resize = self.decide("watchdog", reason, self.split, new, step)
        control.should_save = True
        control.should_training_stop = True
        return True

    def on_init_end(self, args, state, control, **kwargs):
        self.run_args = args

    def on_train_end(self, args, state, control, **kwargs):
        self.bus.write_summary(self.source, {"split": self.split.as_dict(), "decisions": self.decisions})
        if self.decisions and state.is_world_process_zero:
            print(self.format_summary())
        if self.planned_resize and not self.managed and state.is_world_process_zero:
            new = Split(**self.planned_resize["new"])
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            print(f"AdaptiveBatchTuner: memory asked for a smaller micro-batch at step {state.global_step}. "
                  f"A checkpoint is saved to {checkpoint}. Resume with the exact split "
                  f"{', '.join(f'{k}={v}' for k, v in new.as_dict().items())} (effective batch unchanged):\n"
                  f"  trainer.args.per_device_train_batch_size = {new.micro_batch}; "
                  f"trainer.args.gradient_accumulation_steps = {new.grad_accum}; "
                  f"trainer.train(resume_from_checkpoint='{checkpoint}')\n"
                  f"or use hf_perf_callbacks.train_with_tuning(trainer), which does this by itself; the recipe "
                  f"launcher picks the split up from {os.path.join(args.output_dir, SPLIT_FILE)}.")

    # ------------------------------------------------------------ decisions
    def decide(self, kind: str, reason: str, old: Split, new: Split, step: int) -> dict:
        decision = {"kind": kind, "step": step, "reason": reason, "old": asdict(old), "new": asdict(new),
                    "time": time.time()}
        self.decisions.append(decision)
        self.split = new
        self.persist()
        if self.bus is not None:
            self.bus.event(self.source, "decision", f"{kind}: {old} → {new} at step {step} ({reason})", step=step,
                           old_split=asdict(old), new_split=asdict(new))
        return decision

    def persist(self) -> None:
        """Write the split and decisions (atomically; a failure is a warning, never an error on one rank only)."""
        args = self.run_args
        if args is None or not is_main_process():
            return
        path = os.path.join(args.output_dir, SPLIT_FILE)
        try:
            os.makedirs(args.output_dir, exist_ok=True)
            split = self.split or current_split(args)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"split": split.as_dict(), "world_size": world_size(), "session": self.session,
                           "written": self.written, "decisions": self.decisions}, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
        except OSError as error:
            self.warn_once("persist", f"could not write {path}: {error} (the split and decisions are kept in "
                                      f"memory and in the checkpoints)")

    def warn_once(self, key: str, message: str, step: int | None = None) -> None:
        """``message`` as a warning (console and perf log; the logger alone before any trainer event), once per
        ``key`` for this run."""
        if key not in self.warned:
            self.warned.add(key)
            if self.bus is not None:
                self.warn(message, step=step)
            else:
                logger.warning("[tuner] %s", message)

    def export(self) -> dict:
        return {"decisions": self.decisions, "session": self.session, "written": self.written}

    def load(self, saved: dict) -> None:
        self.adopt(saved.get("decisions", []), saved.get("session"), saved.get("written", []))

    def adopt(self, decisions, session, written) -> None:
        """Take over a recorded history when it is longer than this instance's (histories only grow; an in-process
        resume keeps its own newer one, a new process or a rebuilt instance takes the record)."""
        if isinstance(decisions, list) and len(decisions) > len(self.decisions):
            self.decisions = [d for d in decisions if isinstance(d, dict)]
        if isinstance(session, str) and not self.written:
            self.session = session
        for step in written or []:
            if isinstance(step, int) and step not in self.written:
                self.written.append(step)

    def format_summary(self) -> str:
        lines = ["== AdaptiveBatchTuner summary ==", f"split: {self.split}"]
        for d in self.decisions:
            extra = f", recovered in {d['recovery_sec']:.2f} s" if "recovery_sec" in d else ""
            if d["kind"] == "probe":               # its evidence was printed before training
                lines.append(f"step 0: probe {fmt_split(d['old'])} → {fmt_split(d['new'])} "
                             f"({d.get('probe_sec', 0.0):.1f} s probing)")
                continue
            lines.append(f"step {d['step']}: {d['kind']} {fmt_split(d['old'])} → {fmt_split(d['new'])} ({d['reason']}{extra})")
        return "\n".join(lines)



def find_callback(trainer, cls):
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)), None)


def fmt_split(d: dict) -> str:
    return str(Split(d["micro_batch"], d["grad_accum"], d.get("steps_per_generation")))
