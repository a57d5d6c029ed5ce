"""GRPO's rules: a run that cannot learn, a generation-bound step, weight syncs to vLLM, the completion budget.

Generation is measured at TRL's own entry (HF ``generate``, vLLM server and vLLM colocate alike), so the timing rules
read the same figures on every backend and word their causes and advice for the one the run used
(:attr:`~..model.Measurements.generation_backend`).
"""
from __future__ import annotations

from ..model import ZERO, Facts, Finding, Measurements, Note, Rewards, Setting, card
from .advice import (
    CLIPPED_LARGE,
    COMPLETION_HEADROOM,
    HIGH_WATER_FRACTION,
    _bullets,
    _completion_target,
    _gb,
    _generation_batch,
    _pct,
    _phase,
    _raised_limit,
    _under_pressure,
)
from .basis import _too_short
from .formulas import _memory_freed_by_cut

GENERATION_SHARE = 0.5
WEIGHT_SYNC_SHARE = 0.15     # weight syncs to vLLM at or above this share of the wall time: a finding
LAUNCH_BOUND_UTIL = 0.1      # decode bandwidth utilisation below which decode is launch-bound
NO_LEARNING_LOGS = 3         # consecutive logs with zero reward variance in every group and zero gradient norm


def _more_samples(m: Measurements, r: Rewards) -> tuple[list[str], Setting]:
    """Where some prompts score and others do not: more samples per prompt (whole groups in the generation batch)
    and, below 1, a temperature of 1 — the advice's words and its setting."""
    items: list[str] = []
    setting: Setting = {}
    n, gen = m.num_generations, _generation_batch(m)
    if n and r and r.max - r.min > ZERO:       # some prompts score: more samples per prompt can differ
        setting["num_generations"] = 2 * n
        text = (f"`num_generations: {2 * n}` (more samples per prompt: more chances that one scores "
                f"differently from the others)")
        if gen and gen % (2 * n):
            spg = 2 * (m.steps_per_generation or m.grad_accum or 1)
            setting["steps_per_generation"] = spg
            text += f" with `steps_per_generation: {spg}` (the generation batch must hold whole groups)"
        items.append(text)
        t = m.temperature
        if t is not None and t < 1.0:
            setting["temperature"] = 1.0
            items.append(f"`temperature: 1.0` (now {t:g}): more varied samples within a group")
    return items, setting


@card(finding=f"GRPO, ≥ {NO_LEARNING_LOGS} logs: every completion scored the same → partial credit, a check of the "
              "reward, an easier task (no setting: `num_generations`, `temperature` and `max_completion_length` "
              "cannot move a constant reward; a longer limit is a later bullet when most completions were cut); "
              "every group flat while the mean reward moved → `num_generations` ×2",
      gain="no (fix first)",
      note="no reward data in the logs")
def rule_no_learning(m: Measurements) -> Finding | Note | None:
    if not m.grpo:
        return None
    r = m.rewards
    if r is None:
        return Note("no_learning", "No reward data",
                    "No reward data in this run's logs (no `log/reward` in the step lines, no `trainer_state.json` "
                    "with rewards): whether the run can learn was not checked.", judged=False, reason="no_reward_data")
    constant = _constant_reward(r) and r.logs >= NO_LEARNING_LOGS
    if not constant and m.no_signal_run < NO_LEARNING_LOGS:
        if _constant_reward(r):
            return Note("no_learning", "Too few logs to judge the rewards",
                        f"Every completion of the {r.logs} log(s) scored {r.min:.3g}: too few logs to judge "
                        f"whether the run can learn ({NO_LEARNING_LOGS} needed; `logging_steps` sets how often the "
                        f"trainer logs).", judged=False, reason="too_few_logs",
                        facts={"logs": r.logs, "reward": r.min, "logs_needed": NO_LEARNING_LOGS})
        return None
    clipped, limit = m.clipped_ratio or 0.0, m.max_completion_length
    setting: Setting = {}
    facts: Facts = {"logs": r.logs if constant else m.logs, "no_signal_run": m.no_signal_run,
                    "reward_mean": m.reward_mean, "reward_min": r.min, "reward_max": r.max,
                    "source": m.trainer_log_source, "clipped": clipped}
    if constant:
        facts.update({f"reward_func:{name}": lo for name, (lo, _) in r.funcs.items()})
        funcs = ", ".join(f"`{name}` {lo:.3g}" for name, (lo, _) in r.funcs.items())
        obs = (f"On all {r.logs} logs every completion got the same reward, {r.min:.3g}: no prompt group had "
               f"any spread (`reward_std` 0)" + (f"; per reward function: {funcs}" if funcs else "")
               + (f"; the gradient norm was 0 on {m.no_signal_run} consecutive logs" if m.no_signal_run else "")
               + (f" (from the {m.trainer_log_source})." if m.trainer_log_source else "."))
        root = ("GRPO learns from reward differences between the completions of one prompt (each advantage is a "
                "reward minus its group's mean). Every completion of this run scored the same, so every advantage, "
                "the loss and the gradient were 0: the weights never moved. More samples per prompt or a higher "
                "temperature cannot move a reward that no sample of the whole run has moved: the reward gives no "
                "partial credit the model's completions can reach, or the task is too hard for this model.")
        items = ["make the reward give partial credit a sampled completion can reach (the format, a correct part, "
                 "closeness to the answer), so that completions of a group differ",
                 "check the reward functions on a few completions by hand: a reward that is constant by mistake (a "
                 "parsing error that always returns 0) looks exactly like this",
                 "or start where the model succeeds sometimes: an easier task or curriculum, or a model (or a short "
                 "supervised warm-start) that solves some prompts"]
        if clipped >= CLIPPED_LARGE and limit:         # no setting: a length cannot move a constant reward
            raised, _ = _raised_limit(m, limit, clipped)
            facts["raised_limit"] = raised
            items.append(f"then, if the answers need more room: `max_completion_length: {raised}` (now {limit}; "
                         f"{_pct(clipped)} of completions were cut at the limit) — a longer limit cannot make a "
                         f"reward that no completion moved vary by itself")
        title = "The run cannot learn: every completion got the same reward"
    else:
        obs = (f"On {m.no_signal_run} consecutive logs (of {m.logs}) every prompt group's completions got the same "
               f"reward (`frac_reward_zero_std` 1) and the gradient norm was 0"
               + (f"; mean reward {m.reward_mean:.3g}" if m.reward_mean is not None else "")
               + ("; the mean reward differed between logs, so some prompts score and others do not"
                  if r and r.max - r.min > ZERO else "") + ".")
        root = ("GRPO's advantage is each completion's reward minus its group's mean: when all completions of a "
                "group score the same, every advantage is 0, so the loss and the gradient are 0 and the weights do "
                "not move.")
        items = ["reward shaping: give partial credit a sampled completion can reach (format, a correct part, "
                 "closeness), so completions of a group differ"]
        more, setting = _more_samples(m, r)
        items += more
        items.append("check the reward functions on a few completions by hand: a reward that is constant by mistake "
                     "(a parsing error that always returns 0) looks exactly like this")
        title = "The run cannot learn: no reward variance, zero gradients"
    return Finding("no_learning", title, obs, root, _bullets(items), None, "no speed figure: until rewards differ "
                   "within a group no step changes the weights", "high", setting, "try", None, priority=0,
                   reason="constant_reward" if constant else "no_group_variance", facts=facts)


@card(finding=f"GRPO generation ≥ {GENERATION_SHARE:.0%} → vLLM (CUDA), `steps_per_generation` ×2 (with its cost: "
              "later updates learn off-policy)",
      gain="no")
def rule_generation_bound(m: Measurements) -> Finding | None:
    g = _phase(m, "generation")
    if not m.grpo or g < GENERATION_SHARE or _too_short(m):
        return None
    u = m.decode_bandwidth_util
    backend = m.generation_backend or ("vllm" if m.use_vllm else "transformers")
    vllm = backend.startswith("vllm")
    obs = f"Generation (rollouts, {_BACKEND_WORDS.get(backend, backend)}) took {_pct(g)} of the wall time"
    if m.steady_step_sec:
        obs += f" (≈ {g * m.steady_step_sec:.2f} s of a {m.steady_step_sec:.2f} s step)"
    if m.weight_sync_share:
        obs += f", weight syncs to vLLM {_pct(m.weight_sync_share)} of the wall time within it"
    if m.rollout_tokens_per_sec:
        obs += f"; {m.rollout_tokens_per_sec:.0f} completion tokens/s"
    launch_bound = u is not None and u < LAUNCH_BOUND_UTIL and not vllm
    if u is not None:
        obs += f"; decode read the weights at {_pct(u)} of peak memory bandwidth"
        obs += " — launch-bound, not bandwidth-bound" if launch_bound else ""
    obs += "."
    root = ("HF `generate` decodes one token per step for the whole batch and runs every layer for each token; a "
            "batch decodes until its longest completion. Generation does not depend on the training split, so it "
            "dominates a GRPO step.")
    if vllm:
        root = ("TRL generates synchronously: training waits while vLLM decodes the generation batch until its "
                "longest completion (and, after each optimizer step, while the new weights are sent to it). "
                "Generation does not depend on the training split, so it dominates a GRPO step.")
    target = _completion_target(m)
    clipped = m.clipped_ratio or 0.0
    lines: list[str] = []
    setting: Setting = {}
    if m.device_type == "cuda" and not m.use_vllm:
        setting = {"use_vllm": True, "vllm_mode": "colocate"}
        lines += ["`use_vllm: true` with `vllm_mode: colocate` (paged KV cache and CUDA graphs remove the per-token "
                  "launch overhead; `vllm_gpu_memory_utilization: 0.3` leaves room for training)",
                  "or, without vLLM, `cache_implementation: static` (fixed-shape KV cache, no re-allocation per "
                  "token)"]
    if backend == "vllm-server":
        lines.append("more GPUs for the vLLM server (`vllm serve ... --data-parallel-size N`): the generation batch "
                     "is spread over its engines")
    spg = m.steps_per_generation or m.grad_accum
    if spg and not _under_pressure(m):
        steps_per_rollout = 2 * spg / (m.grad_accum or spg)
        text = (f"`steps_per_generation: {2 * spg}` (now {spg}): one generate call for twice the sequences, the same "
                f"decode steps. The cost is on-policy-ness: the rollouts then serve {2 * spg} micro-batches"
                + (f" ({steps_per_rollout:g} optimizer steps)" if steps_per_rollout > 1 else "")
                + ", so the updates after the first learn from completions sampled by older weights (off-policy); "
                  "TRL then computes the sampling policy's log-probabilities (one more forward over the generation "
                  "batch) and clips the importance ratio at `epsilon`")
        if not setting:
            setting = {"steps_per_generation": 2 * spg}
        lines.append(text)
    if target:
        lines.append(f"`max_completion_length: {target[0]}` (the {target[2]} is {target[1]:.0f} tokens; decode "
                     f"steps = the longest completion of a batch)")
        setting = setting or {"max_completion_length": target[0]}
    if clipped >= CLIPPED_LARGE:
        lines.append(f"do not shorten `max_completion_length`: {_pct(clipped)} of completions are already cut at "
                     f"the limit")
    if not lines:
        return None
    formula = (f"not predicted: the run does not measure generation at another batch or backend (generation free "
               f"would be the ceiling, 1/(1 − {g:.2f}) = {1 / (1 - g):.1f}x)")
    return Finding("generation_bound", "Generation-bound GRPO step", obs, root, _bullets(lines), None, formula,
                   "low", setting, "try", None, reason="launch_bound" if launch_bound else "generation_share",
                   facts={"generation": g, "decode_bandwidth_util": u, "backend": backend,
                          "steps_per_generation": spg, "optimizer_steps_per_rollout":
                              2 * spg / (m.grad_accum or spg) if spg and not _under_pressure(m) else None,
                          "completion_target": target[0] if target else None, "clipped": clipped,
                          "ceiling": 1 / (1 - g)})


_BACKEND_WORDS = {"transformers": "HF generate", "transformers-paged": "HF continuous batching",
                  "vllm-server": "vLLM server", "vllm-colocate": "vLLM colocated", "vllm": "vLLM"}


@card(finding=f"GRPO with vLLM: weight syncs ≥ {WEIGHT_SYNC_SHARE:.0%} of the wall time → `steps_per_generation` "
              "×2 (one sync per generation; with its cost: later updates learn off-policy), the server near the "
              "trainer",
      gain="no")
def rule_weight_sync(m: Measurements) -> Finding | None:
    share = m.weight_sync_share
    if not m.grpo or share is None or share < WEIGHT_SYNC_SHARE or _too_short(m):
        return None
    backend = m.generation_backend or "vllm"
    obs = (f"Sending the weights to vLLM ({_BACKEND_WORDS.get(backend, backend)}) took {_pct(share)} of the wall "
           f"time: {m.weight_syncs} syncs"
           + (f" of ≈ {m.weight_sync_sec:.2f} s each" if m.weight_sync_sec else "")
           + (f"; generation as a whole {_pct(_phase(m, 'generation'))}" if _phase(m, "generation") else "") + ".")
    root = ("Before generating after an optimizer step, TRL sends every weight of the model to vLLM "
            "(`VLLMGeneration.sync_weights`; with LoRA the adapters are merged and the whole model is sent), and the "
            "trainer waits for it. Its cost grows with the model, not with the batch, so it weighs most where "
            "generation batches are small.")
    if backend == "vllm-colocate" and m.vllm_enable_sleep_mode:
        root += (" With `vllm_enable_sleep_mode` the engine drops its weights after every generate call (sleep "
                 "level 2), so a second call in one step (tool-call turns, evaluation) sends them again.")
    lines: list[str] = []
    setting: Setting = {}
    spg = m.steps_per_generation or m.grad_accum
    if spg and not _under_pressure(m):
        lines.append(f"`steps_per_generation: {2 * spg}` (now {spg}): one generation, and one sync, for twice the "
                     f"micro-batches; the cost is on-policy-ness (the later updates learn from completions of older "
                     f"weights, and TRL clips the importance ratio)")
        setting = {"steps_per_generation": 2 * spg}
    if backend == "vllm-server":
        lines.append("keep the server on GPUs of the training node (NVLink or PCIe, not across the network): the "
                     "weights travel over NCCL from the training process's first rank")
    if not lines:
        return None
    formula = (f"not predicted: the run measures syncs at one setting (syncs free would be the ceiling, "
               f"1/(1 − {share:.2f}) = {1 / (1 - share):.2f}x)")
    return Finding("weight_sync", "Weight syncs to vLLM take a large share of the step", obs, root, _bullets(lines),
                   None, formula, "medium", setting, "try", None, reason="sync_share",
                   facts={"share": share, "syncs": m.weight_syncs, "sync_sec": m.weight_sync_sec, "backend": backend})


def _cut_off(m: Measurements, obs: str, limit: int, clipped: float) -> Finding:
    """Most completions end at ``max_completion_length``: a quality finding naming the limit and the masking."""
    root = (f"{_pct(clipped)} of completions reached `max_completion_length` {limit} before the model ended them. A "
            "cut completion is scored on an unfinished answer (a missing closing tag or final answer usually scores "
            "0) and, unless masked, trained on as if it were complete.")
    raised, sized = _raised_limit(m, limit, clipped)
    raise_it = (f"`max_completion_length: {raised}` (now {limit}; {sized}) if the answers need the room: each step "
                f"then decodes up to {raised / limit:.0f} times as many tokens (slower) and holds a longer KV cache")
    mask = ("`mask_truncated_completions: true`: cut completions are left out of the loss, so only finished answers "
            f"teach (with {_pct(clipped)} cut, few remain: raise the limit too)")
    headroom = (m.mem_high_water_gb is not None and m.mem_budget_gb
                and m.mem_high_water_gb < HIGH_WATER_FRACTION * m.mem_budget_gb)
    items = [raise_it, mask] if headroom else [mask, raise_it]
    items.append("or reward finishing within the budget (TRL's `get_soft_overlong_punishment`), or ask for shorter "
                 "answers in the prompt")
    setting: Setting = {"max_completion_length": raised} if headroom else {"mask_truncated_completions": True}
    return Finding("completion_budget", "Most completions are cut off at max_completion_length", obs, root,
                   _bullets(items), None, "no speed figure: a quality finding (a higher limit makes steps slower, "
                   "not faster)", "medium", setting, "try", None, reason="cut_off",
                   facts={"limit": limit, "clipped": clipped, "raised_limit": raised, "headroom": bool(headroom)})


@card(finding="GRPO: most completions cut at `max_completion_length` → the limit, `mask_truncated_completions`; "
              "rare runaways reach a limit far above use → a cap",
      gain="no",
      note="no runaways (memory only)")
def rule_completion_budget(m: Measurements) -> Finding | Note | None:
    limit = m.max_completion_length
    if not m.grpo or not limit:
        return None
    clipped = m.clipped_ratio
    stats = ", ".join(f"{name} {value:.0f}" for name, value in (("mean", m.completion_mean),
                                                               ("p90 of per-log max", m.completion_p90),
                                                               ("max", m.completion_max)) if value is not None)
    obs = (f"Completion lengths: {stats or 'n/a'} tokens against `max_completion_length` {limit}"
           + (f"; clipped ratio {_pct(clipped)} (mean over the run's logs)" if clipped is not None else "") + ".")
    if clipped is not None and clipped >= CLIPPED_LARGE:
        return _cut_off(m, obs, limit, clipped)
    target = _completion_target(m)
    if not target:
        return None
    new, basis, name = target
    freed = _memory_freed_by_cut(m, limit, new)
    r = clipped or 0.0
    facts: Facts = {"limit": limit, "target": new, "basis_tokens": basis, "clipped": r,
                    "freed_bytes": freed[0] if freed else None, "completion_max": m.completion_max,
                    "longest_cut": m.completion_max is not None and m.completion_max > new}
    if r <= 0 or _phase(m, "generation") <= 0:
        return Note("completion_budget", "max_completion_length far above what completions use",
                    f"{obs} No completion reached the limit, so time is unchanged by a cap; "
                    f"`max_completion_length: {new}` (next power of two ≥ {COMPLETION_HEADROOM} × the {name}) would "
                    f"bound runaway rollouts"
                    + (f" and free ≈ {_gb(freed[0])} at the limit, if memory is ever short" if freed else "") + ".",
                    reason="no_runaways", facts=facts)
    root = (f"The limit is {limit / basis:.1f}x what the task uses. A completion that never emits end-of-sequence "
            f"decodes to the limit, holds the whole generation batch for {limit} decode steps and pads every "
            f"training sequence of its batch to {limit} tokens.")
    rec = (f"`max_completion_length: {new}` (next power of two ≥ {COMPLETION_HEADROOM} × {basis:.0f} = "
           f"{COMPLETION_HEADROOM * basis:.0f}, the {name}).")
    if m.completion_max is not None and m.completion_max > new:
        rec += f" The longest observed completion ({m.completion_max:.0f}) would be cut."
    if freed:
        rec += f" At the limit this frees ≈ {_gb(freed[0])}: {freed[1]}."
    return Finding("completion_budget", "Runaway completions reach max_completion_length", obs, root, rec, None,
                   f"not predicted: {_pct(r)} of completions reached the limit; how much decode time a cap saves "
                   f"depends on how often a batch holds one", "low", {"max_completion_length": new}, "try", None,
                   reason="runaways", facts=facts)


def _constant_reward(r: Rewards | None) -> bool:
    """Every completion of the run scored the same: the mean reward never moved and no group had any spread."""
    return (r is not None and r.max - r.min <= ZERO and (r.std_max or 0.0) <= ZERO
            and (r.zero_std_min is None or r.zero_std_min >= 1.0 - 1e-9))
