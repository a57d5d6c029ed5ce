"""The memory rule: swapping, pressure, the wall close, or driver memory far above live tensors.
"""
from __future__ import annotations

from ... import keys
from ...core.batching import Split, next_smaller
from ...core.memory import WARN_WITHIN_STEPS as STEPS_TO_WALL  # the watchdog's default warn distance
from ...core.wording import split_label
from ..facts import MemoryPressure, Remedy
from ..model import Finding, Measurements, Setting, card
from ..words import finding
from .advice import (
    CLIPPED_LARGE,
    HIGH_WATER_FRACTION,
    _completion_target,
    _split_setting,
    _splits,
    _swapping,
    _under_pressure,
)
from .formulas import (
    _act_formula,
    _act_per_token,
    _logits_per_token,
    _memory_freed_by_cut,
    _train_formula,
    _training_tokens,
)

DRIVER_BLOAT_RATIO = 1.5
DRIVER_BLOAT_MIN_GB = 0.5


#: a remedy for memory pressure with its setting
Remedial = tuple[Remedy, Setting]


def _allocator_bloat(m: Measurements, swapping: bool) -> bool:
    """The allocator holds far more than live tensors at the driver's peak, where that matters (MPS, near the
    budget, under pressure)."""
    driver, allocated = m.driver_gb_max, m.allocated_gb_at_driver_max
    if driver is None or allocated is None or driver - allocated < DRIVER_BLOAT_MIN_GB:
        return False
    if driver <= DRIVER_BLOAT_RATIO * allocated:
        return False
    near_budget = (m.mem_high_water_gb is not None and m.mem_budget_gb
                   and m.mem_high_water_gb >= HIGH_WATER_FRACTION * m.mem_budget_gb)
    return m.device_type == "mps" or bool(near_budget) or swapping or (m.max_pressure or 0) >= 1


def _checkpointing_remedy(m: Measurements) -> Remedial | None:
    """Activation checkpointing, where it is off: the activations it frees at this run's micro-batch."""
    if m.activation_checkpointing is not False:
        return None
    remedy = Remedy("checkpointing")
    tokens = _training_tokens(m)
    act_now, act_ckpt = _act_per_token(m.model, False), _act_per_token(m.model, True)
    if act_now and act_ckpt and tokens:
        remedy = Remedy("checkpointing", float((act_now - act_ckpt) * tokens[0]), formula=_act_formula(m.model, False),
                        formula_after=_act_formula(m.model, True), tokens=tokens[1])
    return remedy, {"activation_checkpointing": True}


def _smaller_split(m: Measurements) -> Split | None:
    """The next smaller exact split of this run's effective batch (None: micro-batch 1, or none keeps it exact)."""
    splits = _splits(m)                          # empty unless the micro-batch and the accumulation are known
    if not (splits and m.micro_batch and m.grad_accum):
        return None
    try:
        return next_smaller(Split(m.micro_batch, m.grad_accum), splits)
    except ValueError:
        return None


def _smaller_split_remedy(m: Measurements) -> Remedial | None:
    """A smaller micro-batch with more accumulation (the effective batch unchanged): the memory it frees."""
    smaller, micro, accum = _smaller_split(m), m.micro_batch, m.grad_accum
    if smaller is None or not micro or not accum:
        return None
    split = (micro, accum, smaller.micro_batch, smaller.grad_accum)
    remedy = Remedy("smaller_split", split=split)
    ckpt_on = bool(m.activation_checkpointing)
    act_now = _act_per_token(m.model, ckpt_on)
    if act_now and m.seq_len:
        remedy = Remedy("smaller_split", float((act_now + _logits_per_token(m.model)) * m.seq_len
                                               * (micro - smaller.micro_batch)),
                        formula=_train_formula(m.model, ckpt_on), split=split, seq_len=m.seq_len)
    return remedy, _split_setting(m, smaller)


def _completion_remedy(m: Measurements) -> Remedial | None:
    """GRPO: a shorter ``max_completion_length`` (the KV cache and activations it frees), or the hint to try one."""
    target = _completion_target(m)
    if target:
        limit = m.max_completion_length                 # known: a target cuts it
        freed = _memory_freed_by_cut(m, limit, target.new) if limit else None
        return (Remedy("shorter_completions", freed.total_bytes if freed else 0.0, target=target, limit=limit,
                       freed=freed), {"max_completion_length": target.new})
    if m.grpo and (m.clipped_ratio or 0.0) < CLIPPED_LARGE:
        return Remedy("shorter_completions_hint"), {}
    return None


def _advice(m: Measurements, remedies: list[Remedial]) -> tuple[Remedy, ...]:
    """The advice in its order: ``leak_first`` (no setting fixes a leak), ``free_outside`` (memory outside the run
    set or moved the wall), then the remedies by the memory they free."""
    first = [Remedy("leak_first")] if m.leak_mib_per_step else []
    if any(why for _, why, _ in m.wall_moves):
        first.append(Remedy("free_outside", use_vllm=bool(m.use_vllm)))
    return tuple(first + [remedy for remedy, _ in remedies])


def _confidence(m: Measurements, swapping: bool) -> str:
    """The confidence of the finding (no speed figure either way)."""
    if swapping:
        return "medium" if m.swapout_steps >= 3 or (m.swap_growth_gb or 0.0) >= 1.0 else "low"
    return "high" if (m.max_pressure or 0) >= 2 or m.watchdog_actions else "medium"


@card(finding="swapping, pressure, the wall near → the change that frees the most memory (formulas shown); where "
              "the budget moved, between which values, at which steps and why; a leak → fixing it first; memory "
              "held outside the run → freeing it (a lower `vllm_gpu_memory_utilization` with vLLM colocated)",
      gain="no")
def rule_memory_pressure(m: Measurements) -> Finding | None:
    swapping = _swapping(m)
    bloat = _allocator_bloat(m, swapping)
    if not (_under_pressure(m) or bloat):
        return None
    remedies = sorted((r for r in (_checkpointing_remedy(m), _smaller_split_remedy(m), _completion_remedy(m)) if r),
                      key=lambda item: -item[0].saved_bytes)             # the one that frees the most memory first
    setting = next((s for _, s in remedies if s), {})
    near = m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL
    facts = MemoryPressure(
        swapping, m.swap_growth_gb, m.swapout_steps, m.max_pressure, m.mem_high_water_gb, m.mem_budget_gb,
        m.min_steps_to_wall, near, bloat, m.driver_gb_max, m.allocated_gb_at_driver_max, m.leak_mib_per_step,
        m.budget_range_gb, _advice(m, remedies), _allocator_code(m), m.device_type, m.grpo, bool(m.launcher),
        tuple(m.wall_moves), tuple((a.get("action"), a.get("step")) for a in m.watchdog_actions),
        tuple((d.old.micro_batch, d.step, split_label(d.new)) for d in m.memory_limits if d.kind == "oom"))
    urgent = swapping or (m.max_pressure or 0) >= 2 or near
    return finding("memory_pressure", "swapping" if swapping else "near_the_wall" if urgent else "pressure", facts,
                   setting, None, _confidence(m, swapping), "try", None, priority=0 if urgent else 1)


def _allocator_code(m: Measurements) -> str | None:
    """Which allocator advice the finding gives: ``mps_cache_clearer``, ``expandable_segments``."""
    if m.device_type == "mps" and keys.CACHE_CLEARS not in m.logged:
        return "mps_cache_clearer"
    return "expandable_segments" if m.device_type == "cuda" else None
