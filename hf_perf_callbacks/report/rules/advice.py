"""Figures and settings several rule families share: the run's exact splits, the interface it was started with,
the memory cap the advice respects, the completion limits.
"""
from __future__ import annotations

import math

from ...core.batching import Split, exact_splits
from ...core.memory import WARN_WITHIN_STEPS as STEPS_TO_WALL  # the watchdog's default warn distance
from ...core.wording import split_label
from ..facts import CompletionTarget, MemoryHit, RaisedLimit
from ..model import Measurements, Setting

COMPLETION_SLACK = 0.5
COMPLETION_HEADROOM = 1.25
CLIPPED_SMALL = 0.05
CLIPPED_LARGE = 0.5
UNSEEN_LIMIT = 256       # TRL's default max_completion_length: the raised limit when no completion ended
SWAP_GROWTH_GB = 0.25
HIGH_WATER_FRACTION = 0.75   # CUDA: reserved ≫ allocated only matters this close to the budget


def _saved(m: Measurements, gain: float | None) -> float | None:
    """The wall seconds a change of this run's ``gain`` saves: wall × (1 − 1/gain)."""
    return m.wall_sec * (1 - 1 / gain) if gain and gain > 0 and m.wall_sec else None


def _next_pow2(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def _phase(m: Measurements, name: str) -> float:
    return float(m.phases.get(name) or 0.0)


def _completion_target(m: Measurements) -> CompletionTarget | None:
    """A lower max_completion_length where there is room to cut, and the observed length it rests on."""
    limit = m.max_completion_length
    basis, name = (m.completion_p90, "p90") if m.completion_p90 is not None else (m.completion_max, "max")
    if not (m.grpo and limit and basis is not None and basis > 0):
        return None
    if basis >= COMPLETION_SLACK * limit or (m.clipped_ratio or 0.0) > CLIPPED_SMALL:
        return None
    new = _next_pow2(COMPLETION_HEADROOM * basis)
    return CompletionTarget(new, basis, name) if new < limit else None


def _raised_limit(m: Measurements, limit: int, clipped: float) -> RaisedLimit:
    """The ``max_completion_length`` the observed lengths call for when ``clipped`` of the completions reach
    ``limit``, and how it was sized. The completions that ended (share 1 − clipped, mean length t — TRL's
    ``completions/mean_terminated_length``) are taken as spread evenly from x0 = 2t − limit (at least 0) to the
    limit, and the share ended by a length as growing on at that rate: it reaches 1 − :data:`CLIPPED_SMALL` at
    x0 + (1 − CLIPPED_SMALL) × (limit − x0) / (1 − clipped); the next power of two at or above that (at least twice
    the limit, at most 16 times). Without a completion that ended, no length beyond the limit was observed: TRL's
    default limit (:data:`UNSEEN_LIMIT`), within twice to 16 times the limit, said to be a guess (twice the limit
    took two more runs on SmolLM2-135M-Instruct's Wordle answers: 8 → 16 still cut 92%, and 96 still cut 42%)."""
    ended, t = 1.0 - clipped, m.completion_terminated_mean
    if ended <= 0 or t is None or not 0 < t <= limit:
        return RaisedLimit(max(2 * limit, min(16 * limit, UNSEEN_LIMIT)), limit, True, unseen_default=UNSEEN_LIMIT)
    x0 = max(0.0, 2 * t - limit)
    need = x0 + (1 - CLIPPED_SMALL) * (limit - x0) / ended
    return RaisedLimit(min(16 * limit, max(2 * limit, _next_pow2(need))), limit, False, 1 - CLIPPED_SMALL, ended, t,
                       need)


def _splits(m: Measurements) -> list[Split]:
    """Exact splits of this run's effective batch (GRPO: keeping the generation batch and whole prompt groups),
    largest micro-batch first; empty when the batch is unknown or the geometry is not a valid one."""
    if not (m.micro_batch and m.grad_accum):
        return []
    world = max(1, m.world_size or 1)
    effective = m.micro_batch * m.grad_accum * world
    grpo = m.grpo and m.num_generations and m.num_generations >= 2
    try:
        return exact_splits(effective, world, _generation_batch(m) if grpo else None,
                            m.num_generations if grpo else None)
    except ValueError:
        return []


def _generation_batch(m: Measurements) -> int | None:
    """Completions per generation call over all devices: micro-batch × world × steps_per_generation (as configured;
    a tuner re-size keeps it)."""
    if not (m.micro_batch and m.grad_accum):
        return None
    split = Split(m.micro_batch, m.grad_accum, m.steps_per_generation or m.grad_accum)
    return split.generation_batch(max(1, m.world_size or 1))


def _split_setting(m: Measurements, split: Split) -> Setting:
    """The complete config change to run ``split``: micro-batch and accumulation, and for GRPO the
    ``steps_per_generation`` that keeps the generation batch when TRL's default (= accumulation) would not."""
    setting: Setting = {"per_device_train_batch_size": split.micro_batch,
                        "gradient_accumulation_steps": split.grad_accum}
    gen = _generation_batch(m)
    if m.grpo and gen:
        spg = gen // (split.micro_batch * max(1, m.world_size or 1))
        if spg != split.grad_accum:
            setting["steps_per_generation"] = spg
    return setting


def _memory_cap(m: Measurements) -> tuple[int | None, MemoryHit | None]:
    """The largest micro-batch any advice may name — one below the smallest that hit the memory limit (the tuner's
    ``oom``, ``watchdog`` and ``memory_check`` decisions, its trials that did not fit, the watchdog's stops and
    smaller-batch requests) — and that hit; (None, None) when nothing hit the memory limit."""
    hits = [MemoryHit(d.old.micro_batch, d.kind, d.step, d.reason) for d in m.memory_limits]
    hits += [MemoryHit(t.split.micro_batch, "trial", split=split_label(t.split), error=t.error)
             for t in (m.tune.trials if m.tune else []) if not t.fits or (t.error and "memory" in t.error.lower())]
    if not m.memory_limits and m.micro_batch:
        hits += [MemoryHit(m.micro_batch, str(a.get("action")), a.get("step")) for a in m.watchdog_actions
                 if a.get("action") in ("smaller_batch", "stop")]
    if not hits:
        return None, None
    hit = min(hits, key=lambda h: h.micro_batch)
    return max(0, hit.micro_batch - 1), hit


def _swapping(m: Measurements) -> bool:
    return (m.swap_growth_gb or 0.0) >= SWAP_GROWTH_GB or m.swapout_steps > 0


def _under_pressure(m: Measurements) -> bool:
    return _swapping(m) or (m.max_pressure or 0) >= 1 or (
        m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL)
