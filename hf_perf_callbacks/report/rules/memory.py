"""The memory rule: swapping, pressure, the wall close, or driver memory far above live tensors.
"""
from __future__ import annotations

from ... import keys
from ...batching import Split, next_smaller
from ...memory import WARN_WITHIN_STEPS as STEPS_TO_WALL  # the watchdog's default warn distance
from ..model import Facts, Finding, Measurements, Setting, card
from .advice import (
    CLIPPED_LARGE,
    HIGH_WATER_FRACTION,
    _bullets,
    _completion_target,
    _gb,
    _launcher,
    _pct,
    _sentence,
    _split_name,
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


#: (bytes freed, the advice's words, its setting): one remedy for memory pressure
Remedy = tuple[float, str, Setting]
#: what each remedy's words are, by the setting key that marks it (the finding's ``facts["remedies"]``)
REMEDY_CODES = {"activation_checkpointing": "checkpointing", "per_device_train_batch_size": "smaller_split",
                "max_completion_length": "shorter_completions"}


def _near_budget(m: Measurements) -> bool:
    return bool(m.mem_high_water_gb is not None and m.mem_budget_gb
                and m.mem_high_water_gb >= HIGH_WATER_FRACTION * m.mem_budget_gb)


def _cached_gb(m: Measurements) -> float:
    """Driver memory above live tensors at the driver's peak (0 when either is unknown)."""
    driver, allocated = m.driver_gb_max, m.allocated_gb_at_driver_max
    return driver - allocated if driver is not None and allocated is not None else 0.0


def _allocator_bloat(m: Measurements, swapping: bool) -> bool:
    """The allocator holds far more than live tensors, where that matters (MPS, near the budget, under pressure)."""
    driver, allocated = m.driver_gb_max, m.allocated_gb_at_driver_max
    if driver is None or allocated is None or _cached_gb(m) < DRIVER_BLOAT_MIN_GB:
        return False
    if driver <= DRIVER_BLOAT_RATIO * allocated:
        return False
    return m.device_type == "mps" or _near_budget(m) or swapping or (m.max_pressure or 0) >= 1


def _wall_facts(m: Measurements) -> list[str]:
    """The budget, the wall's moves, a leak, the watchdog's actions and the tuner's OOMs, in words."""
    facts = []
    if m.budget_range_gb is not None and m.budget_range_gb[1] > 1.01 * m.budget_range_gb[0]:
        facts.append(f"the budget followed what the run could reach, between {m.budget_range_gb[0]:.2f} and "
                     f"{m.budget_range_gb[1]:.2f} GiB")
    facts += [f"at step {step} the wall {'moved' if moved else 'was set'}: {why}"
              for step, why, moved in m.wall_moves[:4] if why]
    if m.leak_mib_per_step:
        facts.append(f"memory grew by {m.leak_mib_per_step:.0f} MiB on every step: a leak")
    if m.watchdog_actions:
        acts = ", ".join(f"{a.get('action')} at step {a.get('step')}" for a in m.watchdog_actions[:5])
        facts.append(f"the watchdog acted {len(m.watchdog_actions)} times ({acts})")
    facts += [f"micro-batch {d.old.micro_batch} ran out of memory at step {d.step} (the tuner went on at "
              f"{_split_name(d.new)})" for d in m.memory_limits if d.kind == "oom"]
    return facts


def _pressure_facts(m: Measurements, swapping: bool, bloat: bool) -> list[str]:
    """What the run measured of its memory pressure, in words (the finding's observation)."""
    facts = []
    if swapping:
        facts.append(f"swap grew by {m.swap_growth_gb or 0:.2f} GiB" +
                     (f" with swap-outs on {m.swapout_steps} steps" if m.swapout_steps else ""))
    if m.max_pressure:
        facts.append(f"memory pressure reached {('warn', 'critical')[min(m.max_pressure, 2) - 1]} "
                     f"(level {m.max_pressure})")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        facts.append(f"high-water mark {m.mem_high_water_gb:.2f} GiB of a {m.mem_budget_gb:.2f} GiB budget "
                     f"({_pct(m.mem_high_water_gb / m.mem_budget_gb)})")
    if m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL:
        facts.append(f"the budget was {m.min_steps_to_wall:.0f} steps away at the current growth")
    if bloat:
        facts.append(f"the allocator held {m.driver_gb_max:.2f} GiB while live tensors were "
                     f"{m.allocated_gb_at_driver_max:.2f} GiB ({_cached_gb(m):.2f} GiB cached)")
    return facts + _wall_facts(m)


def _root_cause(m: Measurements, swapping: bool) -> str:
    if m.device_type == "mps":
        root = ("Unified memory: Metal memory (weights, activations, the allocator's cache) competes with the OS and "
                "other apps; past the working set macOS compresses and then swaps pages to SSD, and every kernel "
                "that touches a swapped page waits for it.")
    elif m.device_type == "cuda":
        root = ("The GPU works close to its memory limit: the caching allocator retries, fragments and finally "
                "raises out-of-memory; a GPU does not swap, it stops.")
    else:
        root = "Training memory is close to physical RAM: the OS swaps and every step waits for page-ins."
    if swapping and m.grpo:
        root += (" In GRPO the peak is the training forward/backward over prompt + completion tokens (activations "
                 "and full-vocabulary logits) on top of the generation KV cache.")
    return root


def _checkpointing_remedy(m: Measurements) -> Remedy | None:
    """Activation checkpointing, where it is off: the activations it frees at this run's micro-batch."""
    if m.activation_checkpointing is not False:
        return None
    text = "`activation_checkpointing: true` (`gradient_checkpointing` before transformers 5; ~20–30% more compute)"
    saved = 0.0
    tokens = _training_tokens(m)
    act_now, act_ckpt = _act_per_token(m.model, False), _act_per_token(m.model, True)
    if act_now and act_ckpt and tokens:
        saved = (act_now - act_ckpt) * tokens[0]
        text += (f": activations per token {_act_formula(m.model, False)} → {_act_formula(m.model, True)}, "
                 f"× {tokens[1]} frees ≈ {_gb(saved)}")
    return saved, text, {"activation_checkpointing": True}


def _smaller_split(m: Measurements) -> Split | None:
    """The next smaller exact split of this run's effective batch (None: micro-batch 1, or none keeps it exact)."""
    micro, accum = m.micro_batch, m.grad_accum
    splits = _splits(m)                          # empty unless both are known
    if not (splits and micro and accum):
        return None
    try:
        return next_smaller(Split(micro, accum), splits)
    except ValueError:
        return None


def _smaller_split_remedy(m: Measurements) -> Remedy | None:
    """A smaller micro-batch with more accumulation (the effective batch unchanged): the memory it frees."""
    smaller, micro, accum = _smaller_split(m), m.micro_batch, m.grad_accum
    if smaller is None or not micro or not accum:
        return None
    new_mb, new_ga = smaller.micro_batch, smaller.grad_accum
    text = (f"`per_device_train_batch_size: {new_mb}` with `gradient_accumulation_steps: {new_ga}` (effective "
            f"batch {micro} × {accum} = {new_mb} × {new_ga} = {micro * accum}, unchanged)")
    saved = 0.0
    ckpt_on = bool(m.activation_checkpointing)
    act_now = _act_per_token(m.model, ckpt_on)
    if act_now and m.seq_len:
        saved = (act_now + _logits_per_token(m.model)) * m.seq_len * (micro - new_mb)
        text += (f": frees ≈ {_gb(saved)} = ({_train_formula(m.model, ckpt_on)}) × {m.seq_len} tokens × "
                 f"{micro - new_mb} fewer sequences")
    return saved, text, _split_setting(m, smaller)


def _completion_remedy(m: Measurements) -> Remedy | None:
    """GRPO: a shorter ``max_completion_length`` (the KV cache and activations it frees), or the hint to try one."""
    target = _completion_target(m)
    if target:
        text = (f"`max_completion_length: {target[0]}` (now {m.max_completion_length}; the {target[2]} is "
                f"{target[1]:.0f})")
        limit = m.max_completion_length                 # known: a target cuts it
        freed = _memory_freed_by_cut(m, limit, target[0]) if limit else None
        if freed:
            text += f": frees ≈ {_gb(freed[0])} at the limit — {freed[1]}"
        return freed[0] if freed else 0.0, text, {"max_completion_length": target[0]}
    if m.grpo and (m.clipped_ratio or 0.0) < CLIPPED_LARGE:
        return 0.0, ("a shorter `max_completion_length` if the task's answers are short (see "
                     "`completions/max_length` in the logs)"), {}
    return None


def _advice(m: Measurements) -> tuple[list[str], Setting]:
    """The remedies, the one that frees the most memory first, with what no setting fixes around them, and the
    setting of the first remedy that has one."""
    remedies = [r for r in (_checkpointing_remedy(m), _smaller_split_remedy(m), _completion_remedy(m)) if r]
    remedies.sort(key=lambda item: -item[0])
    lines = [text for _, text, _ in remedies]
    setting = next((s for _, _, s in remedies if s), {})
    if any(why for _, why, _ in m.wall_moves):  # memory outside the run set or moved the wall
        lines.insert(0, "free the memory held outside this run (another process on the device, a pool outside "
                        "PyTorch's allocator), or give the run a device of its own"
                        + ("; with vLLM colocated, a lower `vllm_gpu_memory_utilization`" if m.use_vllm else ""))
    if m.leak_mib_per_step:                     # no setting fixes a leak: first
        lines.insert(0, "fix the leak first: memory that grows on every step comes from tensors kept across steps "
                        "(a loss appended without `.item()`, a growing cache); a smaller micro-batch does not stop "
                        "it")
    allocator = _allocator_advice(m)
    return lines + ([allocator] if allocator else []), setting


def _allocator_advice(m: Measurements) -> str | None:
    if m.device_type == "mps" and keys.CACHE_CLEARS not in m.logged:
        return (("add `MPSCacheClearer` to the recipe's `callbacks`" if _launcher(m) else
                 "attach `MPSCacheClearer()` (`callbacks=default_callbacks()` has it)")
                + ": it clears the Metal cache when driver memory runs ahead of live tensors")
    if m.device_type == "cuda":
        return ("`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the environment (less fragmentation of the "
                "reserved memory)")
    return None


def _gain_words(m: Measurements, swapping: bool) -> tuple[str, str]:
    """(what the gain is, the confidence): no speed figure either way."""
    if swapping:
        strong = m.swapout_steps >= 3 or (m.swap_growth_gb or 0.0) >= 1.0
        return ("not predicted: this run never ran without swapping, so its own step time without it is not "
                "measured; swapping steps wait for the SSD and can be several times slower",
                "medium" if strong else "low")
    return ("no swapping observed: no speed-up; the gain is headroom (the GiB freed above) and no lost run",
            "high" if (m.max_pressure or 0) >= 2 or m.watchdog_actions else "medium")


@card(finding="swapping, pressure, the wall near → the change that frees the most memory (formulas shown); where "
              "the budget moved, between which values, at which steps and why; a leak → fixing it first; memory "
              "held outside the run → freeing it (a lower `vllm_gpu_memory_utilization` with vLLM colocated)",
      gain="no")
def rule_memory_pressure(m: Measurements) -> Finding | None:
    swapping = _swapping(m)
    bloat = _allocator_bloat(m, swapping)
    if not (_under_pressure(m) or bloat):
        return None
    lines, setting = _advice(m)
    formula, confidence = _gain_words(m, swapping)
    facts: Facts = {"swapping": swapping, "swap_growth_gb": m.swap_growth_gb, "swapout_steps": m.swapout_steps,
                    "max_pressure": m.max_pressure, "high_water_gb": m.mem_high_water_gb,
                    "budget_gb": m.mem_budget_gb, "steps_to_wall": m.min_steps_to_wall,
                    "allocator_bloat": bloat, "cached_gb": _cached_gb(m) if bloat else None,
                    "leak_mib_per_step": m.leak_mib_per_step, "wall_moves": len(m.wall_moves),
                    "watchdog_actions": ", ".join(f"{a.get('action')}@{a.get('step')}" for a in m.watchdog_actions),
                    "oom_micro_batches": ", ".join(f"{d.old.micro_batch}@{d.step}" for d in m.memory_limits
                                                   if d.kind == "oom"),
                    "remedies": _remedy_codes(m), "allocator_advice": _allocator_code(m)}
    urgent = swapping or (m.max_pressure or 0) >= 2 or (m.min_steps_to_wall is not None
                                                      and m.min_steps_to_wall <= STEPS_TO_WALL)
    return Finding("memory_pressure", "Memory pressure" + (": the run is swapping" if swapping else ""),
                   _sentence(_pressure_facts(m, swapping, bloat)), _root_cause(m, swapping), _bullets(lines), None,
                   formula, confidence, setting, "try", None, priority=0 if urgent else 1,
                   reason="swapping" if swapping else "near_the_wall" if urgent else "pressure", facts=facts)


def _remedy_codes(m: Measurements) -> str:
    """The advice in its order, as codes: ``leak_first``, ``free_outside``, then the remedies by the memory they free
    (:data:`REMEDY_CODES`; ``shorter_completions_hint`` without a setting), comma-separated."""
    remedies = [r for r in (_checkpointing_remedy(m), _smaller_split_remedy(m), _completion_remedy(m)) if r]
    remedies.sort(key=lambda item: -item[0])
    codes = [next((REMEDY_CODES[k] for k in s if k in REMEDY_CODES), "shorter_completions_hint")
             for _, _, s in remedies]
    if any(why for _, why, _ in m.wall_moves):
        codes.insert(0, "free_outside")
    if m.leak_mib_per_step:
        codes.insert(0, "leak_first")
    return ", ".join(codes)


def _allocator_code(m: Measurements) -> str | None:
    """Which allocator advice :func:`_allocator_advice` gives: ``mps_cache_clearer``, ``expandable_segments``."""
    if m.device_type == "mps" and keys.CACHE_CLEARS not in m.logged:
        return "mps_cache_clearer"
    return "expandable_segments" if m.device_type == "cuda" else None
