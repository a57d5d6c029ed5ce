"""The rules of the phases a user controls, each with a gain from the run's own measured seconds (the meter's phase
clocks, :mod:`hf_perf_callbacks.timeline`): checkpoint saves, logging and the callbacks, recompute.

Each gain is the run's wall time over the wall time without the seconds the change removes, those seconds measured
on this run (a save, a log, a recompute costing what this run's did): ``measured``, as the evaluation rule's.
"""
from __future__ import annotations

from ..model import Finding, Measurements, Note, Setting, card
from .advice import FLOOR, _bullets, _gb, _pct
from .formulas import _act_per_token
from .run import _nice_interval

SAVE_SHARE = 0.1             # saving's share of the wall time worth a finding
SAVE_TARGET = 0.05           # the share the advised save_steps brings it to
CALLBACK_SHARE = 0.1         # the user's callbacks and logging: share of the wall time worth a finding
LOG_TARGET = 0.05            # the share the advised logging_steps brings the log-driven time to
RECOMPUTE_SHARE = 0.03       # recompute's share of the wall time worth a finding
MEMORY_ROOM = 0.85           # the high-water mark plus the activations kept must stay below this share of the budget


def _wall(m: Measurements) -> float:
    return float(m.wall_sec or 0.0)


def _interval(per_event: float, other_per_step: float, every: int, target: float) -> int:
    """The next 1, 2, 5 × 10^k steps between events at which an event costing ``per_event`` seconds takes about
    ``target`` of the wall time beside ``other_per_step`` seconds a step (at least ``every`` + 1)."""
    needed = per_event * (1 - target) / (target * other_per_step) if other_per_step > 0 else every * 10
    return max(every + 1, _nice_interval(needed))


def _spaced(m: Measurements, seconds: float, events: int, every: int | None,
            target: float) -> tuple[int, float, int, float, float]:
    """An event costing ``seconds`` over ``events`` runs, every ``every`` steps (None: read from the count): (every,
    the other seconds per step, the interval at which it takes about ``target`` of the wall time, the seconds that
    interval saves, the gain)."""
    wall, steps = _wall(m), max(1, m.steps)
    every = every or max(1, round(steps / events))
    other_per_step = (wall - seconds) / steps
    new = _interval(seconds / events, other_per_step, every, target)
    saved = seconds * (1 - every / new)
    return every, other_per_step, new, saved, wall / (wall - saved)


def _setting_int(m: Measurements, name: str) -> int | None:
    value = m.trainer_settings.get(name)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1 else None


@card(finding=f"checkpoint saving ≥ {SAVE_SHARE:.0%} of the wall time, ≥ 2 saves (`perf/phase_sec/save`, measured) → "
              f"`save_steps` at which it takes ~{SAVE_TARGET:.0%}; `save_only_model`",
      gain="measured: the run's own save seconds at the new interval")
def rule_saving(m: Measurements) -> Finding | None:
    """Checkpoint saving's share of the wall time, measured on this run's own saves: ``save_steps``."""
    wall, save, n = _wall(m), m.phase_sec.get("save", 0.0), m.saves
    if wall <= 0 or n < 2 or save / wall < SAVE_SHARE or not m.steps:
        return None
    per_save = save / n
    every = _setting_int(m, "save_steps") if m.trainer_settings.get("save_strategy") == "steps" else None
    every, other_per_step, new, saved, gain = _spaced(m, save, n, every, SAVE_TARGET)
    obs = (f"{n} checkpoint saves (every {every} step{'s' if every != 1 else ''}) took {save:.1f} s of the run's "
           f"{wall:.1f} s wall time ({_pct(save / wall)}), {per_save:.3g} s each, against {other_per_step:.3g} s of "
           f"everything else per step.")
    root = ("Each save writes the model, and unless `save_only_model` is set the optimizer and scheduler state too, "
            "to disk while training waits; saving every few steps spends more time writing checkpoints than "
            "training.")
    setting: Setting = {"save_strategy": "steps", "save_steps": new}
    items = [f"`save_steps: {new}` (now every {every}): saving then takes about "
             f"{_pct(per_save / new / (per_save / new + other_per_step))} of the wall time"]
    if m.trainer_settings.get("save_only_model") is not True:
        items.append("`save_only_model: true` writes the weights alone (no optimizer state: smaller and faster, but "
                     "a resume from it restarts the optimizer)")
    if m.trainer_settings.get("save_total_limit") is None:
        items.append("`save_total_limit: 2` bounds the disk the checkpoints take (not their time)")
    items.append("with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`; this "
                 "transformers version has no asynchronous checkpoint save")
    formula = (f"measured: this run's {n} saves took {save:.1f} s; every {new} steps instead of {every} saves "
               f"{saved:.1f} s of {wall:.1f} s: {wall:.1f} / ({wall:.1f} − {saved:.1f}) = {gain:.2f}x (each save "
               f"costing what this run's did)")
    return Finding("saving", "Checkpoint saving takes a large share of the wall time", obs, root, _bullets(items),
                   gain, formula + FLOOR, "high", setting, "measured", gain, lower_bound=True, reason="save_share")


def _user_callbacks(m: Measurements) -> list[tuple[str, float, dict[str, float]]]:
    """The user's callback classes by their seconds, the costliest first: (class, seconds, event → seconds)."""
    out = [(name, sum(events.values()), events) for name, events in m.callback_sec.items()]
    return sorted((c for c in out if c[1] > 0), key=lambda c: -c[1])


@card(finding=f"the user's callbacks and logging ≥ {CALLBACK_SHARE:.0%} of the wall time (`perf/phase_sec/"
              "user_callbacks`, `perf/phase_sec/log`, each callback class's seconds) → `logging_steps` when the time "
              "is in `on_log`; else the callback named",
      gain="measured: the run's own log seconds at the new interval (per-step callback work: no number)")
def rule_callbacks(m: Measurements) -> Finding | None:
    """The user's callbacks and the trainer's logging, measured per callback class and event."""
    wall, user, log = _wall(m), m.phase_sec.get("user_callbacks", 0.0), m.phase_sec.get("log", 0.0)
    if wall <= 0 or (user + log) / wall < CALLBACK_SHARE or not m.steps:
        return None
    classes = _user_callbacks(m)
    named = "; ".join(f"`{name}` {sec:.1f} s (" + ", ".join(f"{e} {s:.1f} s" for e, s in
                                                               sorted(events.items(), key=lambda x: -x[1]) if s > 0)
                      + ")" for name, sec, events in classes[:4])
    on_log = sum(events.get("on_log", 0.0) for _, _, events in classes) + log
    obs = (f"Callbacks of this run other than the package's took {user:.1f} s and the trainer's logging {log:.1f} s "
           f"of the {wall:.1f} s wall time ({_pct((user + log) / wall)})" + (f": {named}" if named else "") + ".")
    logs, every = m.training_logs, _setting_int(m, "logging_steps")
    if on_log / wall >= CALLBACK_SHARE and logs >= 2:
        per_log = on_log / logs
        every, other_per_step, new, saved, gain = _spaced(m, on_log, logs, every, LOG_TARGET)
        root = (f"The work runs at every training log: {logs} logs (every {every} step{'s' if every != 1 else ''}) "
                f"cost {per_log:.3g} s each in `on_log` and the trainer's log, against {other_per_step:.3g} s of "
                "everything else per step; the time between steps was not waiting for data.")
        items = [f"`logging_steps: {new}` (now {every}): the log-driven work then takes about "
                 f"{_pct(per_log / new / (per_log / new + other_per_step))} of the wall time",
                 "or make the costly callback's `on_log` cheaper (a `model.generate` or an evaluation inside it runs "
                 "at every log)"]
        formula = (f"measured: this run's {logs} logs cost {on_log:.1f} s; every {new} steps instead of {every} "
                   f"saves {saved:.1f} s of {wall:.1f} s: {wall:.1f} / ({wall:.1f} − {saved:.1f}) = {gain:.2f}x")
        return Finding("callbacks", "Logging and callbacks take a large share of the wall time", obs, root,
                       _bullets(items), gain, formula + FLOOR, "high", {"logging_steps": new}, "measured", gain,
                       lower_bound=True, reason="logging_share")
    if not classes:
        return None
    name, sec, events = classes[0]
    event = max(events, key=lambda e: events[e])
    root = (f"`{name}` spends {sec:.1f} s in its callbacks, most in `{event}`: work the trainer waits for at every "
            "such event; the time between steps was not waiting for data.")
    items = [f"make `{name}.{event}` cheaper, or let it act every N steps (`if state.global_step % N == 0`)",
             "or remove the callback from `callbacks`"]
    formula = (f"not predicted: how often the callback must run is the user's choice; all of its {sec:.1f} s of "
               f"{wall:.1f} s would be {wall / max(1e-9, wall - sec):.2f}x")
    return Finding("callbacks", f"Callback {name} takes a large share of the wall time", obs, root, _bullets(items),
                   None, formula, "medium", {}, "try", None, reason="one_callback", facts={"callback": name})


@card(finding=f"gradient checkpointing's recompute ≥ {RECOMPUTE_SHARE:.0%} of the wall time (clocked on CPUs) and "
              f"the activations it saves fit below {MEMORY_ROOM:.0%} of the budget (the watchdog's high-water mark) "
              "→ `activation_checkpointing: false`",
      gain="measured: the run's own recompute seconds",
      note="recompute kept: the activations would not fit")
def rule_recompute(m: Measurements) -> Finding | Note | None:
    """Recompute nobody needs: gradient checkpointing on (TRL's SFT and GRPO configs turn it on by default) with the
    memory to keep the activations."""
    wall, recompute = _wall(m), m.phase_sec.get("recompute", 0.0)
    if not m.activation_checkpointing or not m.recompute_clocked or wall <= 0 or recompute / wall < RECOMPUTE_SHARE:
        return None
    kept, freed = _act_per_token(m.model, False), _act_per_token(m.model, True)
    if kept is None or freed is None or not m.micro_batch or not m.seq_len:
        return None
    if m.mem_high_water_gb is None or not m.mem_budget_gb:
        return None
    extra = (kept - freed) * m.micro_batch * m.seq_len
    after = m.mem_high_water_gb + extra / 2**30
    if after > MEMORY_ROOM * m.mem_budget_gb:
        return Note("recompute", "Gradient checkpointing kept: the activations would not fit",
                    f"Recompute took {recompute:.1f} s ({_pct(recompute / wall)} of the wall time), but keeping the "
                    f"activations would take about {_gb(extra)} more: {after:.2f} of the {m.mem_budget_gb:.2f} GiB "
                    "budget, above the watchdog's margin.", reason="would_not_fit")
    gain = wall / (wall - recompute)
    obs = (f"Gradient checkpointing re-ran the checkpointed layers' forwards for {recompute:.1f} s of the "
           f"{wall:.1f} s wall time ({_pct(recompute / wall)}); memory peaked at {m.mem_high_water_gb:.2f} of "
           f"{m.mem_budget_gb:.2f} GiB.")
    root = ("Activation checkpointing trades compute for memory: the backward runs each layer's forward again. "
            "TRL's `SFTConfig` and `GRPOConfig` turn it on by default (`gradient_checkpointing: true`), whether "
            f"or not the memory is short; here keeping the activations takes about {_gb(extra)} more "
            f"(micro-batch {m.micro_batch} × {m.seq_len} tokens), {after:.2f} GiB of the {m.mem_budget_gb:.2f} GiB "
            "budget.")
    rec = ("`activation_checkpointing: false` (TRL: `gradient_checkpointing: false`); keep the `MemoryWatchdog` "
           "attached: it stops or re-sizes the run before the wall")
    formula = (f"measured: this run's recompute took {recompute:.1f} s of {wall:.1f} s: {wall:.1f} / "
               f"({wall:.1f} − {recompute:.1f}) = {gain:.2f}x")
    return Finding("recompute", "Gradient checkpointing recomputes with memory to spare", obs, root, rec, gain,
                   formula + FLOOR, "medium", {"activation_checkpointing": False}, "measured", gain, lower_bound=True,
                   reason="memory_to_spare")
