"""The rules of the phases a user controls, each with a gain from the run's own measured seconds (the meter's phase
clocks, :mod:`hf_perf_callbacks.core.timeline`): checkpoint saves, logging and the callbacks, recompute.

Each gain is the run's wall time over the wall time without the seconds the change removes, those seconds measured
on this run (a save, a log, a recompute costing what this run's did): ``measured``, as the evaluation rule's. An
interval's events are counted as transformers 5 runs them (:func:`~.run.events`): its last save at the end of a run
whose last step is not a multiple of ``save_steps``, the log of the run's metrics after training whatever
``logging_steps`` is.
"""
from __future__ import annotations

import dataclasses

from ..facts import CallbackTimes, Interval, LoggingShare, OneCallback, Recompute, SaveShare
from ..model import Finding, Measurements, Note, Setting, card
from ..words import finding, note
from .formulas import _act_per_token
from .run import _interval, events

SAVE_SHARE = 0.1             # saving's share of the wall time worth a finding
SAVE_TARGET = 0.05           # the share the advised save_steps brings it to
CALLBACK_SHARE = 0.1         # the user's callbacks and logging: share of the wall time worth a finding
LOG_TARGET = 0.05            # the share the advised logging_steps brings the log-driven time to
RECOMPUTE_SHARE = 0.03       # recompute's share of the wall time worth a finding
MEMORY_ROOM = 0.85           # the high-water mark plus the activations kept must stay below this share of the budget


def _spaced(m: Measurements, seconds: float, count: int, every: int | None, target: float,
            final: bool = False) -> Interval:
    """An event whose ``count`` runs took ``seconds``, every ``every`` steps (None: read from the count), spaced out
    to the interval at which it takes about ``target`` of the wall time, its runs there counted as transformers
    runs them (:func:`~.run.events`; ``final``: the log after training)."""
    wall, steps = m.wall_sec or 0.0, max(1, m.steps)
    every = every or max(1, round(steps / max(1, count - final)))
    per_event, other = seconds / count, wall - seconds
    new = _interval(per_event, other / steps, every, target)
    first = m.trainer_settings.get("logging_first_step") is True and final
    after = min(count, events(steps, new, at_end=not final, first=first, final=final))
    saved = per_event * (count - after)
    return Interval(every, new, other / steps, steps, after, saved, wall / (wall - saved),
                    per_event * after / (per_event * after + other))


def _setting_int(m: Measurements, name: str) -> int | None:
    value = m.trainer_settings.get(name)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1 else None


@card(finding=f"checkpoint saving ≥ {SAVE_SHARE:.0%} of the wall time, ≥ 2 saves (`perf/phase_sec/save`, measured) → "
              f"`save_steps` at which it takes ~{SAVE_TARGET:.0%}; `save_only_model`",
      gain="measured: the run's own save seconds at the new interval")
def rule_saving(m: Measurements) -> Finding | None:
    """Checkpoint saving's share of the wall time, measured on this run's own saves: ``save_steps``."""
    wall, save, n = m.wall_sec or 0.0, m.phase_sec.get("save", 0.0), m.saves
    if wall <= 0 or n < 2 or save / wall < SAVE_SHARE or not m.steps:
        return None
    every = _setting_int(m, "save_steps") if m.trainer_settings.get("save_strategy") == "steps" else None
    spaced = _spaced(m, save, n, every, SAVE_TARGET)
    facts = SaveShare(n, save, wall, spaced, m.trainer_settings.get("save_only_model") is True,
                      m.trainer_settings.get("save_total_limit") is not None)
    setting: Setting = {"save_strategy": "steps", "save_steps": spaced.new_every}
    return finding("saving", "save_share", facts, setting, spaced.gain, "high", "measured", spaced.gain,
                   lower_bound=True, stake_sec=spaced.saved_sec)


@card(finding=f"the user's callbacks and logging ≥ {CALLBACK_SHARE:.0%} of the wall time (`perf/phase_sec/"
              "user_callbacks`, `perf/phase_sec/log`, each callback class's seconds) → `logging_steps` when the time "
              "is in `on_log`; else the callback named",
      gain="measured: the run's own log seconds at the new interval (per-step callback work: no number)")
def rule_callbacks(m: Measurements) -> Finding | None:
    """The user's callbacks and the trainer's logging, measured per callback class and event."""
    wall, user, log = m.wall_sec or 0.0, m.phase_sec.get("user_callbacks", 0.0), m.phase_sec.get("log", 0.0)
    if wall <= 0 or (user + log) / wall < CALLBACK_SHARE or not m.steps:
        return None
    classes = sorted(((name, sec, by_event) for name, by_event in m.callback_sec.items()    # the costliest first
                      if (sec := sum(by_event.values())) > 0), key=lambda c: -c[1])
    times = CallbackTimes(user, log, wall, tuple(
        (name, sec, tuple((e, t) for e, t in sorted(by_event.items(), key=lambda x: -x[1]) if t > 0))
        for name, sec, by_event in classes))
    on_log = sum(by_event.get("on_log", 0.0) for _, _, by_event in classes) + log
    logs, every = m.training_logs, _setting_int(m, "logging_steps")
    if on_log / wall >= CALLBACK_SHARE and logs >= 2:
        spaced = _spaced(m, on_log, logs + 1, every, LOG_TARGET, final=True)   # and the log after training
        return finding("callbacks", "logging_share", LoggingShare(times, logs, on_log, spaced),
                       {"logging_steps": spaced.new_every}, spaced.gain, "high", "measured", spaced.gain,
                       lower_bound=True, stake_sec=spaced.saved_sec)
    if not classes:
        return None
    name, sec, by_event = classes[0]
    return finding("callbacks", "one_callback", OneCallback(times, name, max(by_event, key=lambda e: by_event[e]), sec),
                   {}, None, "medium", "try", None, stake_sec=sec)


@card(finding=f"gradient checkpointing's recompute ≥ {RECOMPUTE_SHARE:.0%} of the wall time (clocked on CPUs) and "
              f"the activations it saves fit below {MEMORY_ROOM:.0%} of the budget (the watchdog's high-water mark) "
              "→ `activation_checkpointing: false`",
      gain="measured: the run's own recompute seconds",
      note="recompute kept: the activations would not fit")
def rule_recompute(m: Measurements) -> Finding | Note | None:
    """Recompute nobody needs: gradient checkpointing on (TRL's SFT and GRPO configs turn it on by default) with the
    memory to keep the activations."""
    wall, recompute = m.wall_sec or 0.0, m.phase_sec.get("recompute", 0.0)
    if not m.activation_checkpointing or not m.recompute_clocked or wall <= 0 or recompute / wall < RECOMPUTE_SHARE:
        return None
    kept, freed = _act_per_token(m.model, False), _act_per_token(m.model, True)
    if kept is None or freed is None or not m.micro_batch or not m.seq_len:
        return None
    if m.mem_high_water_gb is None or not m.mem_budget_gb:
        return None
    extra = (kept - freed) * m.micro_batch * m.seq_len
    after = m.mem_high_water_gb + extra / 2**30
    facts = Recompute(recompute, wall, extra, after, m.mem_budget_gb, m.mem_high_water_gb, m.micro_batch, m.seq_len)
    if after > MEMORY_ROOM * m.mem_budget_gb:
        return note("recompute", "would_not_fit", facts)
    gain = wall / (wall - recompute)
    return finding("recompute", "memory_to_spare", dataclasses.replace(facts, gain=gain),
                   {"activation_checkpointing": False}, gain, "medium", "measured", gain, lower_bound=True,
                   stake_sec=recompute)
