"""The memory rule: swapping, pressure, the wall close, or driver memory far above live tensors.
"""
from __future__ import annotations

from typing import Any

from ... import keys
from ...batching import Split, next_smaller
from ..model import Finding, Measurements
from .advice import (
    CLIPPED_LARGE,
    HIGH_WATER_FRACTION,
    STEPS_TO_WALL,
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


def rule_memory_pressure(m: Measurements) -> Finding | None:
    swapping = _swapping(m)
    driver, allocated = m.driver_gb_max, m.allocated_gb_at_driver_max
    gap = (driver - allocated) if (driver is not None and allocated is not None) else 0.0
    near = (m.mem_high_water_gb is not None and m.mem_budget_gb
            and m.mem_high_water_gb >= HIGH_WATER_FRACTION * m.mem_budget_gb)
    bloat = (driver is not None and allocated is not None and gap >= DRIVER_BLOAT_MIN_GB
             and driver > DRIVER_BLOAT_RATIO * allocated
             and (m.device_type == "mps" or near or swapping or (m.max_pressure or 0) >= 1))
    if not (_under_pressure(m) or bloat):
        return None
    facts = []
    if swapping:
        facts.append(f"swap grew by {m.swap_growth_gb or 0:.2f} GB" +
                     (f" with swap-outs on {m.swapout_steps} steps" if m.swapout_steps else ""))
    if m.max_pressure:
        facts.append(f"memory pressure reached {('warn', 'critical')[min(m.max_pressure, 2) - 1]} "
                     f"(level {m.max_pressure})")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        facts.append(f"high-water mark {m.mem_high_water_gb:.2f} GB of a {m.mem_budget_gb:.2f} GB budget "
                     f"({_pct(m.mem_high_water_gb / m.mem_budget_gb)})")
    if m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL:
        facts.append(f"the budget was {m.min_steps_to_wall:.0f} steps away at the current growth")
    if bloat:
        facts.append(f"the allocator held {m.driver_gb_max:.2f} GB while live tensors were "
                     f"{m.allocated_gb_at_driver_max:.2f} GB ({gap:.2f} GB cached)")
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
    obs = _sentence(facts)
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
    items: list[tuple[float, str, dict[str, Any]]] = []   # (bytes freed, advice, setting): the largest first
    tokens = _training_tokens(m)
    ckpt_on = bool(m.activation_checkpointing)
    act_now = _act_per_token(m.model, ckpt_on)
    if m.activation_checkpointing is False:
        text = ("`activation_checkpointing: true` (`gradient_checkpointing` before transformers 5; ~20–30% more "
                "compute)")
        saved = 0.0
        act_ckpt = _act_per_token(m.model, True)
        if act_now and act_ckpt and tokens:
            saved = (act_now - act_ckpt) * tokens[0]
            text += (f": activations per token {_act_formula(m.model, False)} → {_act_formula(m.model, True)}, "
                     f"× {tokens[1]} frees ≈ {_gb(saved)}")
        items.append((saved, text, {"activation_checkpointing": True}))
    micro, accum = m.micro_batch, m.grad_accum
    splits = _splits(m)                          # empty unless both are known
    try:
        smaller = next_smaller(Split(micro, accum), splits) if splits and micro and accum else None
    except ValueError:                          # micro-batch 1, or no smaller split keeps the batch exact
        smaller = None
    if smaller and micro and accum:
        new_mb, new_ga = smaller.micro_batch, smaller.grad_accum
        text = (f"`per_device_train_batch_size: {new_mb}` with `gradient_accumulation_steps: {new_ga}` (effective "
                f"batch {micro} × {accum} = {new_mb} × {new_ga} = {micro * accum}, unchanged)")
        saved = 0.0
        if act_now and m.seq_len:
            saved = (act_now + _logits_per_token(m.model)) * m.seq_len * (micro - new_mb)
            text += (f": frees ≈ {_gb(saved)} = ({_train_formula(m.model, ckpt_on)}) × {m.seq_len} tokens × "
                     f"{micro - new_mb} fewer sequences")
        items.append((saved, text, _split_setting(m, smaller)))
    target = _completion_target(m)
    if target:
        text = (f"`max_completion_length: {target[0]}` (now {m.max_completion_length}; the {target[2]} is "
                f"{target[1]:.0f})")
        limit = m.max_completion_length                 # known: a target cuts it
        freed = _memory_freed_by_cut(m, limit, target[0]) if limit else None
        if freed:
            text += f": frees ≈ {_gb(freed[0])} at the limit — {freed[1]}"
        items.append((freed[0] if freed else 0.0, text, {"max_completion_length": target[0]}))
    elif m.grpo and (m.clipped_ratio or 0.0) < CLIPPED_LARGE:
        items.append((0.0, "a shorter `max_completion_length` if the task's answers are short (see "
                           "`completions/max_length` in the logs)", {}))
    items.sort(key=lambda item: -item[0])
    lines = [text for _, text, _ in items]
    setting = next((s for _, _, s in items if s), {})
    if any(why for _, why, _ in m.wall_moves):  # memory outside the run set or moved the wall
        lines.insert(0, "free the memory held outside this run (another process on the device, a pool outside "
                        "PyTorch's allocator), or give the run a device of its own"
                        + ("; with vLLM colocated, a lower `vllm_gpu_memory_utilization`" if m.use_vllm else ""))
    if m.leak_mib_per_step:                     # no setting fixes a leak: first
        lines.insert(0, "fix the leak first: memory that grows on every step comes from tensors kept across steps "
                        "(a loss appended without `.item()`, a growing cache); a smaller micro-batch does not stop "
                        "it")
    if m.device_type == "mps" and keys.CACHE_CLEARS not in m.logged:
        lines.append(("add `MPSCacheClearer` to the recipe's `callbacks`" if _launcher(m) else
                      "attach `MPSCacheClearer()` (`callbacks=default_callbacks()` has it)")
                     + ": it clears the Metal cache when driver memory runs ahead of live tensors")
    elif m.device_type == "cuda":
        lines.append("`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the environment (less fragmentation "
                     "of the reserved memory)")
    if swapping:
        formula = ("not predicted: this run never ran without swapping, so its own step time without it is not "
                   "measured; swapping steps wait for the SSD and can be several times slower")
        strong = m.swapout_steps >= 3 or (m.swap_growth_gb or 0.0) >= 1.0
        confidence = "medium" if strong else "low"
    else:
        formula = "no swapping observed: no speed-up; the gain is headroom (the GB freed above) and no lost run"
        confidence = "high" if (m.max_pressure or 0) >= 2 or m.watchdog_actions else "medium"
    urgent = swapping or (m.max_pressure or 0) >= 2 or (m.min_steps_to_wall is not None
                                                      and m.min_steps_to_wall <= STEPS_TO_WALL)
    return Finding("memory_pressure", "Memory pressure" + (": the run is swapping" if swapping else ""), obs, root,
                   _bullets(lines), None, formula, confidence, setting, "try", None, priority=0 if urgent else 1)
