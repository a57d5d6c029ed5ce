"""Reading a run into :class:`~.model.Measurements`: the headline figures (:func:`.figures.figures`, never
recomputed), the trainer's own logs, the tuner's decisions, the run header's facts. Every logged value is read
through a typed accessor: a field of another type is skipped and listed, never a crash. Pure: no torch.
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import keys
from ..core.dataloader import dataloader_facts
from ..core.runlog import (
    HEADER_KINDS,
    PHASES,
    ActionDetails,
    NoteDetails,
    RunHeader,
    RunLog,
    WallMove,
    WarningFigures,
    WatchdogAction,
    number,
    read_run,
    strict_number,
)
from ..core.splitfile import SplitFile, read_split_file
from ..core.stats import classify_slow_steps, quantile
from .figures import (
    Figures,
    _median,
    _steady,
    _steady_values,
    _values,
    completion_stats,
    figures,
    finite,
    last_value,
    slow_stretches,
    split_levels,
    timed_rows,
    trainer_logs,
)
from .model import (
    CONTENTION_RATIO,
    CONTENTION_SHARE,
    MEM_GRACE_STEPS,
    MIN_FIXED_LENGTH_STEPS,
    MIN_MACHINE_CYCLES,
    RECOMPILE_SLOWDOWN,
    ZERO,
    CompileReadings,
    Contention,
    Evaluation,
    FigureReadings,
    FirstSteady,
    GenerationReadings,
    GeometryReadings,
    Machine,
    Measurements,
    MemoryReadings,
    ModelFacts,
    PhaseReadings,
    RecipeTarget,
    Recompile,
    Rewards,
    ScopeReadings,
    StepCounts,
    TrainerReadings,
    TunerReadings,
)


def _mean(values: Iterable[float]) -> float | None:
    """The mean of the values (one pass, no list), None without any."""
    n, total = 0, 0.0
    for v in values:
        n, total = n + 1, total + v
    return total / n if n else None


def _spread(column: Iterable[float]) -> tuple[int, float, float, float]:
    """(count, first, least, largest) of a column's numbers (its NaN left out), in one pass without a list."""
    n, first, low, high = 0, math.nan, math.inf, -math.inf
    for v in column:
        if v == v:
            if not n:
                first = v
            n, low, high = n + 1, min(low, v), max(high, v)
    return n, first, low, high


def _rewards(logs: Sequence[Mapping[str, Any]]) -> Rewards | None:
    """:class:`~.model.Rewards` of the training logs (a function's range: ``rewards/<name>/mean``); None when the logs
    hold no reward."""
    means = _values(logs, "reward")
    if not means:
        return None
    funcs: dict[str, list[float]] = {}
    for h in logs:
        for k, v in h.items():
            if k.startswith("rewards/") and k.endswith("/mean") and (x := strict_number(v)) is not None:
                funcs.setdefault(k[len("rewards/"):-len("/mean")], []).append(x)
    stds, zero = _values(logs, "reward_std"), _values(logs, "frac_reward_zero_std")
    return Rewards(logs=len(means), min=min(means), max=max(means), std_max=max(stds, default=None),
                   zero_std_min=min(zero, default=None), funcs={n: (min(v), max(v)) for n, v in sorted(funcs.items())})


def _no_signal(logs: Sequence[Mapping[str, Any]]) -> tuple[int, int, float | None]:
    """(GRPO logs with reward statistics, the longest run of consecutive logs where every group had zero reward
    variance and the gradient norm was 0, the mean reward over that run)."""
    rows = [(h, zero_std) for h in logs if (zero_std := number(h.get("frac_reward_zero_std"))) is not None]
    best, run = 0, 0
    best_rewards: list[float] = []
    rewards: list[float] = []
    for h, zero_std in rows:
        grad = number(h.get("grad_norm"))
        flat = zero_std >= 1.0 - 1e-9 and (grad is None or abs(grad) <= ZERO)
        if flat:
            run += 1
            reward = number(h.get("reward"))
            if reward is not None:
                rewards.append(reward)
            if run > best:
                best, best_rewards = run, list(rewards)
        else:
            run, rewards = 0, []
    return len(rows), best, (statistics.fmean(best_rewards) if best_rewards else None)


def _slow_steps(run_log: RunLog, f: Figures, rows: list[int], walls: list[float],
                cpus: list[float]) -> tuple[list[tuple[int, float, float]], float, str, float]:
    """(the slow steps as (line, wall, CPU), the seconds lost, where that figure comes from, the steady steps'
    wall/CPU ratio): the meter's figure and its steps when it has them, else the step lines' classification."""
    steady_set, numbers = set(_steady(run_log)), run_log.step_numbers()
    steady = [(w, c) for i, w, c in zip(rows, walls, cpus) if numbers[i] in steady_set] or list(zip(walls, cpus))
    wall0, cpu0 = statistics.median(w for w, _ in steady), statistics.median(c for _, c in steady)
    split = classify_slow_steps(walls, cpus, wall0, cpu0, tolerance=0.2)
    slow = [(i, w, c) for i, w, c, label in zip(rows, walls, cpus, split.labels) if label == "contention"]
    if f.contention_sec is None:
        return slow, split.contention_sec, "step lines", wall0 / cpu0
    if f.contention_steps:                                  # the meter's figure; its steps when it lists them
        wanted = set(f.contention_steps)
        slow = [(i, w, c) for i, w, c in zip(rows, walls, cpus) if numbers[i] in wanted]
    return slow, f.contention_sec, "meter", wall0 / cpu0


def _contention(run_log: RunLog, f: Figures) -> Contention | None:
    """Slow steps that other processes caused (CPU device: wall time above the steady level that no extra process
    CPU time explains): the meter's own figure (``contention_sec`` / the summary's ``early_contention_sec``, with the
    steps when it lists them), else, for a log without it, the same classification
    (:func:`~hf_perf_callbacks.core.stats.classify_slow_steps` at a 20% tolerance) over the step lines. A step counts
    only when its own wall/CPU ratio stands above the steady steps' by :data:`CONTENTION_RATIO` (the meter judges each
    ``train()`` call against its own early steps; a step at the run's steady ratio was not slowed by other processes):
    when some listed steps do not, the time lost is recounted over those that do (their wall seconds beyond their CPU
    time at the steady ratio). None on other devices (CPU time is not the work there), without
    ``perf/cpu_sec``, or when nothing was lost."""
    if run_log.header("perf").device_type != "cpu":
        return None
    rows, walls, cpus = timed_rows(run_log)
    if len(rows) < 4:
        return None
    slow, lost_sec, source, ratio = _slow_steps(run_log, f, rows, walls, cpus)
    corroborated = [(i, w, c) for i, w, c in slow if w / c > ratio * (1 + CONTENTION_RATIO)]
    left_out = source == "meter" and len(slow) < len(f.contention_steps or [])   # the meter's steps that saved
    if len(corroborated) < len(slow) or left_out:          # recount over the steps whose own ratio shows it
        lost_sec = sum(max(0.0, w - c * ratio) for _, w, c in corroborated)
        source = "step lines"
    if not corroborated or lost_sec <= 0:
        return None
    numbers, others_col = run_log.step_numbers(), run_log.column(keys.PERF_OTHER_CPU_CORES)
    others = [v for v in (others_col[i] for i, _, _ in corroborated) if v == v]
    run_sec = sum(walls)
    return Contention(lost_sec=lost_sec, source=source, steps=len(corroborated),
                      step_list=[numbers[i] for i, _, _ in corroborated], run_sec=run_sec,
                      lost_share=lost_sec / run_sec, wall_over_cpu=statistics.median(w / c for _, w, c in corroborated),
                      steady_wall_over_cpu=ratio, other_cores=max(others) if others else None)


def _tail(run_log: RunLog) -> dict[str, float]:
    """The meter's seconds per phase after the last step (its summary's ``tail_phase_sec``: the last log, evaluation
    and save), {} without it."""
    tail = run_log.summary("perf").get("tail_phase_sec")
    return {str(k): float(v) for k, v in tail.items() if number(v) is not None} if isinstance(tail, dict) else {}


def _phase_readings(run_log: RunLog) -> PhaseReadings:
    """:class:`PhaseReadings`; each callback class's seconds from the summary's ``callback_sec``, else (a killed
    run) the step lines' ``perf/callback_sec/*``."""
    col, tail = run_log.column, _tail(run_log)
    phase_sec = {p: sum(finite(col(keys.PERF_PHASE_SEC[p]))) + tail.get(p, 0.0) for p in PHASES}
    wall = sum(finite(col(keys.PERF_STEP_WALL_SEC))) + sum(tail.values())
    saves = sum(1 for v in col(keys.PERF_PHASE_SEC["save"]) if v > 0) + (tail.get("save", 0.0) > 0)
    perf = run_log.summary("perf")
    callbacks = perf.get("callback_sec")
    if isinstance(callbacks, dict) and all(isinstance(v, dict) for v in callbacks.values()):
        callback_sec = {str(k): {str(e): float(x) for e, x in v.items() if number(x) is not None}
                        for k, v in callbacks.items()}
    else:
        callback_sec = {k.removeprefix(keys.PERF_CALLBACK_SEC): {"all events": sum(finite(col(k)))}
                        for k in sorted(run_log.keys_logged()) if k.startswith(keys.PERF_CALLBACK_SEC)}
    settings = run_log.header("perf").trainer_settings
    return PhaseReadings(phase_sec=phase_sec, wall_sec=wall or None, saves=int(saves),
                         training_logs=sum(1 for v in col(keys.TRAINER_LOG + "loss") if v == v),
                         callback_sec=callback_sec, trainer_settings=dict(settings or {}),
                         recompute_clocked=perf.get("recompute_clocked") is True)


def _evaluation(run_log: RunLog, train_sec: float, wall: float) -> Evaluation | None:
    """The run's evaluations as measured on its step lines (``perf/phase_sec/eval`` > 0) and after its last step
    (the meter's tail): how many, every how many steps (the median gap), their seconds, the run's ``wall`` and
    training seconds and evaluation's share of the wall time; None without any."""
    numbers = run_log.step_numbers()
    tail = _tail(run_log)
    at = [(numbers[i], v) for i, v in enumerate(run_log.column(keys.PERF_PHASE_SEC["eval"])) if v == v and v > 0]
    if numbers and tail.get("eval", 0.0) > 0:              # after the last step: the line the next step would have
        at.append((numbers[-1] + 1, tail["eval"]))
    if not at:
        return None
    gaps = [b - a for (a, _), (b, _) in zip(at, at[1:])]
    every = int(statistics.median(gaps)) if gaps else max(1, len(numbers))
    eval_sec = sum(v for _, v in at)
    return Evaluation(evals=len(at), every=max(1, every), eval_sec=eval_sec, wall_sec=wall, train_sec=train_sec,
                      steps=len(numbers), share=eval_sec / wall if wall > 0 else 0.0)


def _first_steady(run_log: RunLog, f: Figures) -> FirstSteady | None:
    """The latest ``train()`` call's first step when the meter counted it steady (no warmup beyond it): its training
    seconds and the steady step time with and without it (the figures' definition); None otherwise."""
    first = f.call_first_step
    steady = set(f.steady_steps or [])
    if first not in steady:
        return FirstSteady(first, included=False) if first else None
    count, total, own = 0, 0.0, None
    for n, t in zip(run_log.step_numbers(), run_log.column(keys.PERF_TRAIN_SEC)):
        if t == t and n in steady:
            count, total = count + 1, total + t
            own = t if n == first else own
    if own is None or count < 2:
        return FirstSteady(first, included=False)
    return FirstSteady(first, included=True, sec=own, with_it=total / count, without_it=(total - own) / (count - 1))


def _trainer_kind(logs: Sequence[Mapping[str, Any]]) -> str | None:
    """The TRL trainer whose own training logs these are, where they show it: SFT logs `mean_token_accuracy`
    (and `num_tokens`), DPO `rewards/chosen`."""
    keys_seen = {k for h in logs[:50] for k in h}
    if "mean_token_accuracy" in keys_seen:
        return "sft"
    if "rewards/chosen" in keys_seen:
        return "dpo"
    return None


def _fact(header: RunHeader, name: str, skipped: list[str]) -> Any:
    """A run-header fact by name, None when absent; one of another type (kept in ``malformed`` by the reader) is
    noted in ``skipped``."""
    if name in header.malformed:
        kind = HEADER_KINDS[name]
        skipped.append(f"run header `{name}` is {header.malformed[name]!r}, not {'an' if kind == 'int' else 'a'} "
                       f"{kind}")
    return getattr(header, name)


#: one whole cycle of ``period`` steps: (wall seconds, CPU seconds, tokens, all of its steps steady)
Cycle = tuple[float, float, float, bool]


def _cpu_rows(walls: Sequence[float], cpus: Sequence[float], others: Sequence[float]) -> list[int]:
    """The lines with a wall time, a CPU time and the other processes' busy cores."""
    return [i for i, (wall, cpu, other) in enumerate(zip(walls, cpus, others))
            if wall == wall and cpu == cpu and other == other and wall > 0 and cpu > 0
            and math.isfinite(cpu / wall + other)]


def _cores_and_threads(header: RunHeader, rows: list[int], walls: Sequence[float], cpus: Sequence[float],
                       others: Sequence[float], load: float | None,
                       skipped: list[str]) -> tuple[int | None, str, int | None, str]:
    """(cores, where that count comes from, torch's threads, where that count comes from): the run header's facts,
    else the busy cores of a saturated machine and torch's default of one thread per core."""
    cores, cores_from = _fact(header, "cpu_cores", skipped), "run header"
    if cores is None and load is not None and load >= 1.0:
        cores = max(1, round(max(cpus[i] / walls[i] + max(0.0, others[i]) for i in rows)))
        cores_from = "the cores counted as the busy cores of the saturated machine"
    threads, threads_from = _fact(header, "torch_threads", skipped), "run header"
    if threads is None and cores:
        threads, threads_from = cores, "the threads taken as torch's default, one per core"
    return cores, cores_from, threads, threads_from


def _cycles(run_log: RunLog, rows: list[int], period: int, walls: Sequence[float],
            cpus: Sequence[float]) -> list[Cycle]:
    """The whole cycles of ``period`` steps among ``rows`` (GRPO counts a cycle's tokens at its start)."""
    numbers, tokens = run_log.step_numbers(), run_log.column(keys.PERF_TOKENS)
    steady_set = set(_steady(run_log))
    cycles: list[Cycle] = []
    for _, group in itertools.groupby(rows, key=lambda i: (numbers[i] - 1) // period):
        lines = list(group)
        if len(lines) == period:
            cycles.append((sum(walls[i] for i in lines), sum(cpus[i] for i in lines),
                           sum(t if (t := tokens[i]) == t else 0.0 for i in lines),
                           all(numbers[i] in steady_set for i in lines)))
    return cycles


def _cycle_spread(cycles: list[Cycle]) -> tuple[float | None, float | None, float | None]:
    """(spread, cpu_spread, lower_bound) over the steady cycles (without :data:`MIN_MACHINE_CYCLES` of them, all but
    the first); Nones without that many cycles to compare."""
    steady = [c for c in cycles if c[3]]
    later = steady if len(steady) >= MIN_MACHINE_CYCLES else cycles[1:]
    work = [(w, c, t) for w, c, t, _ in later if t > 0]
    if len(work) < MIN_MACHINE_CYCLES:
        return None, None, None
    per_wall, per_cpu = [w / t for w, _, t in work], [c / t for _, c, t in work]
    p10 = quantile(per_wall, 0.1)
    lower_bound = sum(w for w, _, _ in work) / sum(t for _, _, t in work) / p10
    return quantile(per_wall, 0.9) / p10, quantile(per_cpu, 0.9) / quantile(per_cpu, 0.1), lower_bound


def _machine(run_log: RunLog, header: RunHeader, skipped: list[str]) -> Machine | None:
    """:class:`Machine`, from the step lines' ``perf/cpu_sec``, ``perf/step_wall_sec``, ``perf/other_cpu_cores``,
    ``perf/load_per_core`` and ``perf/tokens`` and the run header's ``cpu_cores`` and ``torch_threads`` (without
    them: a saturated machine's busy cores, one thread per core). The spreads are over whole cycles of the header's
    ``period`` steps, the steady ones (without :data:`MIN_MACHINE_CYCLES` of them, all but the first); None without
    CPU time in the step lines."""
    col = run_log.column
    walls, cpus, others = col(keys.PERF_STEP_WALL_SEC), col(keys.PERF_CPU_SEC), col(keys.PERF_OTHER_CPU_CORES)
    rows = _cpu_rows(walls, cpus, others)
    if not rows:
        return None
    loads = finite(col(keys.PERF_LOAD_PER_CORE)[i] for i in rows)
    load = statistics.median(loads) if loads else None
    cores, cores_from, threads, threads_from = _cores_and_threads(header, rows, walls, cpus, others, load, skipped)
    spread, cpu_spread, lower_bound = _cycle_spread(_cycles(run_log, rows, max(1, header.period or 1), walls, cpus))
    return Machine(steps=len(rows), busy=statistics.median(cpus[i] / walls[i] for i in rows),
                   other=statistics.median(max(0.0, others[i]) for i in rows), load=load, cores=cores,
                   cores_from=cores_from, threads=threads, threads_from=threads_from, spread=spread,
                   cpu_spread=cpu_spread,
                   lower_bound=lower_bound if lower_bound and lower_bound >= 1.0 + CONTENTION_SHARE else None)


def _split_file(run_log: RunLog, skipped: list[str]) -> SplitFile | None:
    """This run's record from the tuner (:func:`~hf_perf_callbacks.core.splitfile.read_split_file`, the one reader, for
    the perf log's session); a file that is there but is not read is noted in ``skipped``."""
    if not run_log.output_dir:
        return None
    found = read_split_file(run_log.output_dir, session=run_log.header().session)
    if found is None and os.path.exists(os.path.join(run_log.output_dir, keys.SPLIT_FILE)):
        skipped.append(f"`{keys.SPLIT_FILE}` is another run's record or does not follow this version's schema: its "
                       f"decisions are skipped")
    return found


def _skipped(run_log: RunLog) -> list[str]:
    """The run's fields of another type than this version reads (a step line's value that is not a number, counted
    per key: every metric is one), and its unreadable lines, in words."""
    skipped = [f"run header `{k}` is {v!r}" for h in run_log.headers for k, v in h.malformed.items()]
    skipped += [f"the {source} summary's `{k}` is {v!r}" for source, line in sorted(run_log.summaries.items())
                for k, v in line.malformed.items()]
    bad: dict[str, int] = {}
    for s in run_log.unique_steps():
        for k in s.non_numbers():
            bad[k] = bad.get(k, 0) + 1
    skipped += [f"`{k}` is not a number on {n} step line(s)" for k, n in sorted(bad.items())]
    if run_log.skipped_lines:
        skipped.append(f"{run_log.skipped_lines} unreadable line(s) in {keys.PERF_LOG}")
    return skipped


def _step_counts(run_log: RunLog, grpo: bool) -> StepCounts:
    fpm = _median(finite(run_log.column(keys.PERF_FORWARDS_PER_MICROBATCH)))
    n, first, low, high = _spread(run_log.column(keys.PERF_SEQ_LEN))     # without a list
    fixed = int(first) if not grpo and n >= MIN_FIXED_LENGTH_STEPS and low == high else None
    return StepCounts(forwards_per_microbatch=fpm, pad_fraction=_mean(_steady_values(run_log, keys.PERF_PAD_FRACTION)),
                      seq_len=int(high) if n else None, seq_len_min=int(low) if n else None,
                      seq_len_mean=_mean(_steady_values(run_log, keys.PERF_SEQ_LEN)), fixed_seq_len=fixed,
                      decode_bandwidth_util=_median(list(_steady_values(run_log, keys.PERF_DECODE_BANDWIDTH_UTIL))))


def _generation_readings(run_log: RunLog, run: RunHeader, skipped: list[str]) -> GenerationReadings:
    backend = _fact(run, "generation_backend", skipped)
    wall = sum(sum(finite(run_log.column(keys.PERF_PHASE_SEC[p]))) for p in keys.PHASES)
    syncs = [v for v in finite(run_log.column(keys.PERF_WEIGHT_SYNC_SEC)) if v > 0]
    scored = [b for r, b in zip(run_log.column(keys.PERF_REWARD_SEC), run_log.column(keys.PERF_GENERATION_BATCH))
              if r == r and r > 0]
    logged = run_log.keys_logged()
    return GenerationReadings(
        generation_backend=backend, vllm_enable_sleep_mode=_fact(run, "vllm_enable_sleep_mode", skipped),
        weight_sync_steps=_fact(run, "weight_sync_steps", skipped),
        staleness_mean=_mean(finite(run_log.column(keys.TRAINER_LOG + "sample/staleness_mean"))),
        weight_sync_share=sum(syncs) / wall if wall and keys.PERF_WEIGHT_SYNC_SEC in logged else None,
        weight_sync_sec=sum(syncs) / len(syncs) if syncs else None, weight_syncs=len(syncs),
        rollout_tokens_per_sec=_median(list(_steady_values(run_log, keys.PERF_ROLLOUT_TOKENS_PER_SEC))),
        reward_calls=len(scored), reward_completions=_mean(b for b in scored if b == b))


def _target(header: RunHeader) -> RecipeTarget | None:
    """The recipe's target the launcher recorded (the run header's ``target``), None without one."""
    t = header.target
    recipe = t.get("recipe")
    if not isinstance(recipe, str):
        return None
    memory = t.get("memory")
    length = t.get("max_completion_length")
    return RecipeTarget(recipe, _text(t.get("machine")), _text(t.get("device_type")), _text(t.get("model")),
                        length if isinstance(length, int) and not isinstance(length, bool) else None,
                        dict(memory) if isinstance(memory, dict) else {})


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _scope_readings(run_log: RunLog, run: RunHeader) -> ScopeReadings:
    params = run.model.get("params")
    metrics = number(run_log.summary("perf").get("compute_metrics_sec"))
    return ScopeReadings(target=_target(run), model_name=_text(run.model.get("name")),
                         model_params=params if isinstance(params, int) and not isinstance(params, bool) else None,
                         mfu_basis=run.mfu_basis, torch_compile=run.trainer_settings.get("torch_compile") is True,
                         compute_metrics_sec=metrics)


def _compile_readings(run_log: RunLog, f: Figures, torch_compile: bool) -> CompileReadings:
    """CPU device: the child processes' CPU seconds over the steps outside the steady figures (a compile's workers,
    DataLoader workers starting), and with ``torch_compile`` the steady steps slowed by the process's own work: a
    step's training seconds at least :data:`RECOMPILE_SLOWDOWN` above the steady steps' median s (the median: a
    recompile does not move it), at least half of the excess explained by its training CPU seconds above their
    median c (at s / c wall seconds each)."""
    if run_log.header("perf").device_type != "cpu":
        return CompileReadings()
    numbers, train = run_log.step_numbers(), run_log.column(keys.PERF_TRAIN_SEC)
    walls, cpus, child = (run_log.column(k) for k in (keys.PERF_STEP_WALL_SEC, keys.PERF_CPU_SEC,
                                                       keys.PERF_CHILD_CPU_SEC))
    steady = set(f.steady_steps)
    outside = finite(child[i] for i, n in enumerate(numbers) if n not in steady)
    recompiles: list[Recompile] = []
    rows = [i for i, n in enumerate(numbers) if n in steady and walls[i] > 0 and cpus[i] == cpus[i]]
    if torch_compile and rows:
        train_cpu = {i: cpus[i] * train[i] / walls[i] for i in rows}
        s, c = statistics.median(train[i] for i in rows), statistics.median(train_cpu.values())
        for i in rows:
            excess = train[i] - s
            if s > 0 and c > 0 and excess >= RECOMPILE_SLOWDOWN * s:
                share = min(1.0, max(0.0, train_cpu[i] - c) * s / c / excess)
                if share >= 0.5:
                    recompiles.append(Recompile(numbers[i], excess, share))
    return CompileReadings(warmup_child_cpu_sec=sum(outside) if outside else None, recompiles=recompiles)


def _watchdog_actions(run_log: RunLog) -> list[WatchdogAction]:
    """The watchdog's actions: its summary's list, else (a killed run) its action and stop events."""
    actions = run_log.summary("mem").get("actions")
    if actions is not None:                              # a list: the reader keeps another type in ``malformed``
        return [WatchdogAction(step=a.get("step"), action=a.get("action"), message=a.get("message"))
                for a in actions if isinstance(a, dict)]
    return [WatchdogAction(step=e.step, action=ActionDetails.from_details(e.details).action, message=e.message)
            for e in run_log.events if e.source == "mem" and e.kind in ("action", "stop")]


def _memory_readings(run_log: RunLog) -> MemoryReadings:
    steps, events = run_log.unique_steps(), run_log.events
    driver = [(gb, i) for i, gb in enumerate(run_log.column(keys.MEM_DRIVER_GB)) if gb == gb]
    row = steps[max(driver, key=lambda d: d[0])[1]] if driver else None
    swaps = _spread(run_log.column(keys.MEM_SWAP_USED_GB))
    pressures = _spread(run_log.column(keys.MEM_PRESSURE))
    limits = _spread(run_log.column(keys.MEM_LIMIT_GB))
    mem_events = [e for e in events if e.source == "mem"]
    return MemoryReadings(
        driver_gb_max=row.number(keys.MEM_DRIVER_GB) if row else None,
        allocated_gb_at_driver_max=row.number(keys.MEM_ALLOCATED_GB) if row else None,
        max_pressure=int(pressures[3]) if pressures[0] else None,
        swap_growth_gb=max(0.0, swaps[3] - swaps[1]) if swaps[0] else None,
        swapout_steps=sum(1 for v in finite(run_log.column(keys.MEM_SWAPOUTS)) if v > 0),
        min_steps_to_wall=min(finite(run_log.column(keys.MEM_STEPS_TO_WALL)[MEM_GRACE_STEPS:]), default=None),
        watchdog_actions=_watchdog_actions(run_log),
        budget_range_gb=(limits[2], limits[3]) if limits[0] else None,
        wall_moves=[(e.step, wall.why or "", wall.moved)
                    for e in mem_events if e.kind == "wall" for wall in [WallMove.from_details(e.details)]],
        leak_mib_per_step=max((v for v in (WarningFigures.from_details(e.details).leak_mib_per_step
                                           for e in mem_events) if v is not None), default=None))


def _geometry(run_log: RunLog, run: RunHeader) -> GeometryReadings:
    """:class:`GeometryReadings`: a re-size keeps the generation batch, so its steps per generation are this split's
    share of it."""
    steps = run_log.unique_steps()
    micro = last_value(steps, keys.TUNER_MICRO_BATCH) or run.per_device_train_batch_size
    accum = last_value(steps, keys.TUNER_GRAD_ACCUM) or run.gradient_accumulation_steps
    spg = run.steps_per_generation
    if spg and micro and run.per_device_train_batch_size:
        spg = max(1, int(spg) * int(run.per_device_train_batch_size) // int(micro))
    return GeometryReadings(micro_batch=int(micro) if micro else None, grad_accum=int(accum) if accum else None,
                            steps_per_generation=int(spg) if spg else None)


def _trainer_readings(run_log: RunLog, grpo: bool) -> TrainerReadings:
    logs = trainer_logs(run_log)
    completion = completion_stats(logs)
    n_logs, no_signal_run, reward_mean = _no_signal(logs)
    return TrainerReadings(completion_mean=completion["mean"], completion_max=completion["max"],
                           completion_p90=completion["p90"], clipped_ratio=completion["clipped"],
                           completion_terminated_mean=completion["terminated_mean"], logs=n_logs,
                           no_signal_run=no_signal_run, reward_mean=reward_mean,
                           rewards=_rewards(logs) if grpo else None,
                           trainer_kind=_trainer_kind(logs) if not grpo else None)


def _tuner_readings(run_log: RunLog, skipped: list[str]) -> TunerReadings:
    tuner = _split_file(run_log, skipped)
    hint = next((e.message for e in run_log.events if e.source == "tuner"
                 and NoteDetails.from_details(e.details).needs == "train_with_tuning"), None)
    return TunerReadings(tuner_attached=keys.TUNER_MICRO_BATCH in run_log.keys_logged(),
                         tune=tuner.last("tune") if tuner else None,
                         memory_limits=[d for d in tuner.decisions if d.kind in ("oom", "watchdog", "memory_check")]
                         if tuner else [], tuner_hint=hint)


def measurements(run_log: RunLog) -> Measurements:
    """Reduce a parsed run log to what the rules look at (plus ``tuner_split.json``: the tuner's decisions).

    The latest training session's summaries count (a resumed session that was killed has none, so the figures
    come from the step lines), and a step logged again after an out-of-memory rollback or a resume counts once
    (its latest line); the trainer's own logs come from the step lines' ``log/<key>`` values.
    """
    f = figures(run_log)
    skipped = _skipped(run_log)
    run = run_log.header("perf")
    grpo = bool(run.grpo)
    train_sec = sum(finite(run_log.column(keys.PERF_TRAIN_SEC)))
    scope, phases = _scope_readings(run_log, run), _phase_readings(run_log)
    groups = (FigureReadings(steps=f.steps, warmup_steps=f.warmup_steps, warmup_done=f.warmup_done,
                             warmup_overhead_sec=f.warmup_overhead_sec, first_step_slowdown=f.first_step_slowdown,
                             steady_step_sec=f.steady_step_sec, steady_tokens_per_sec=f.steady_tokens_per_sec,
                             mfu=f.mfu, phases=dict(f.phases), mem_high_water_gb=f.high_water_gb,
                             mem_budget_gb=f.budget_gb, steady_steps=len(f.steady_steps) if f.warmup_done else 0,
                             warmup_in_band=f.warmup_in_band, warmup_tolerance=f.warmup_tolerance),
              _geometry(run_log, run), _step_counts(run_log, grpo), _memory_readings(run_log),
              _trainer_readings(run_log, grpo), _tuner_readings(run_log, skipped),
              _generation_readings(run_log, run, skipped), phases, scope,
              _compile_readings(run_log, f, scope.torch_compile))
    return Measurements(
        device_type=run.device_type or "unknown", world_size=int(run.world_size or 1), grpo=grpo,
        max_completion_length=run.max_completion_length, num_generations=run.num_generations,
        activation_checkpointing=run.activation_checkpointing, model=ModelFacts.of(run.model),
        dataloader=dataloader_facts(run.dataloader), pad_to_multiple_of=run.pad_to_multiple_of,
        temperature=run.temperature, use_vllm=run.use_vllm,
        contention=_contention(run_log, f), machine=_machine(run_log, run, skipped),
        slow_stretches=slow_stretches(run_log), split_levels=len(split_levels(run_log)),
        evaluation=_evaluation(run_log, train_sec, phases.wall_sec or 0.0), first_steady=_first_steady(run_log, f),
        launcher=_fact(run, "launcher", skipped), logged=run_log.keys_logged(), skipped=skipped,
        train_sec=train_sec or None,
        **{k: v for group in groups for k, v in vars(group).items()})   # each group's fields, as its reader read them


def measurements_from_run(output_dir: str) -> Measurements:
    """:func:`measurements` of the run in ``output_dir`` (raises :class:`~hf_perf_callbacks.core.runlog.ReportError`, a
    ``ValueError``, when it holds no readable ``perf_log.jsonl``)."""
    return measurements(read_run(output_dir))
