"""GRPO's rules: a run that cannot learn, a generation-bound step, weight syncs to vLLM, the completion budget.

Generation is measured at TRL's own entry (HF ``generate``, vLLM server and vLLM colocate alike), so the timing rules
read the same figures on every backend and word their causes and advice for the one the run used
(:attr:`~..model.Measurements.generation_backend`).
"""
from __future__ import annotations

import dataclasses

from ..facts import (
    CompletionLengths,
    CutOff,
    GenerationBound,
    NoLearning,
    NoRewardData,
    RewardShare,
    RolloutWait,
    Runaways,
    TooFewLogs,
    WeightSync,
)
from ..model import ZERO, Finding, Measurements, Note, Rewards, Setting, card
from ..words import finding, note
from .advice import (
    CLIPPED_LARGE,
    COMPLETION_HEADROOM,
    HIGH_WATER_FRACTION,
    _completion_target,
    _generation_batch,
    _phase,
    _raised_limit,
    _under_pressure,
)
from .basis import _too_short
from .formulas import _memory_freed_by_cut

GENERATION_SHARE = 0.5
REWARD_SHARE = 0.1           # GRPO's reward functions at or above this share of the wall time: a finding
WEIGHT_SYNC_SHARE = 0.15     # weight syncs to vLLM at or above this share of the wall time: a finding
ROLLOUT_WAIT_SHARE = 0.25    # async GRPO: the trainer waiting for rollouts at or above this share: a finding
ASYNC = "vllm-async"         # the backend of TRL's AsyncGRPOTrainer
LAUNCH_BOUND_UTIL = 0.1      # decode bandwidth utilisation below which decode is launch-bound
NO_LEARNING_LOGS = 3         # consecutive logs with zero reward variance in every group and zero gradient norm


def _more_samples(m: Measurements, r: Rewards) -> Setting:
    """Where some prompts score and others do not: more samples per prompt (whole groups in the generation batch)
    and, below 1, a temperature of 1."""
    setting: Setting = {}
    n, gen = m.num_generations, _generation_batch(m)
    if n and r and r.max - r.min > ZERO:       # some prompts score: more samples per prompt can differ
        setting["num_generations"] = 2 * n
        if gen and gen % (2 * n):
            setting["steps_per_generation"] = 2 * (m.steps_per_generation or m.grad_accum or 1)
        t = m.temperature
        if t is not None and t < 1.0:
            setting["temperature"] = 1.0
    return setting


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
        return note("no_learning", "no_reward_data", NoRewardData(), judged=False)
    flat = _constant_reward(r)
    constant = flat and r.logs >= NO_LEARNING_LOGS
    if not constant and m.no_signal_run < NO_LEARNING_LOGS:
        return note("no_learning", "too_few_logs", TooFewLogs(r.logs, r.min, NO_LEARNING_LOGS),
                    judged=False) if flat else None
    clipped, limit = m.clipped_ratio or 0.0, m.max_completion_length
    facts = NoLearning(r.logs if constant else m.logs, m.no_signal_run, m.reward_mean, r.min, r.max, clipped)
    if constant:                                         # no setting: a length cannot move a constant reward
        facts = dataclasses.replace(facts, reward_funcs=tuple((name, lo) for name, (lo, _) in r.funcs.items()),
                                    raised=_raised_limit(m, limit, clipped) if clipped >= CLIPPED_LARGE and limit
                                    else None)
        return finding("no_learning", "constant_reward", facts, {}, None, "high", "try", None, priority=0)
    facts = dataclasses.replace(facts, reward_varied=r.max - r.min > ZERO, temperature=m.temperature)
    return finding("no_learning", "no_group_variance", facts, _more_samples(m, r), None, "high", "try", None,
                   priority=0)


@card(finding=f"GRPO generation ≥ {GENERATION_SHARE:.0%} → vLLM (CUDA), `steps_per_generation` ×2 (with its cost: "
              "later updates learn off-policy)",
      gain="no")
def rule_generation_bound(m: Measurements) -> Finding | None:
    g = _phase(m, "generation")
    if not m.grpo or g < GENERATION_SHARE or _too_short(m) or m.generation_backend == ASYNC:
        return None                              # async GRPO's trainer does not generate: its weight syncs are its own
    u = m.decode_bandwidth_util
    backend = m.generation_backend or ("vllm" if m.use_vllm else "transformers")
    launch_bound = u is not None and u < LAUNCH_BOUND_UTIL and not backend.startswith("vllm")
    target = _completion_target(m)
    clipped = m.clipped_ratio or 0.0
    setting: Setting = {}
    suggest_vllm = m.device_type == "cuda" and not m.use_vllm
    if suggest_vllm:
        setting = {"use_vllm": True, "vllm_mode": "colocate"}
    spg = m.steps_per_generation or m.grad_accum
    double = bool(spg) and not _under_pressure(m)
    if spg and double and not setting:
        setting = {"steps_per_generation": 2 * spg}
    if target:
        setting = setting or {"max_completion_length": target.new}
    facts = GenerationBound(g, u, backend, spg, 2 * spg / (m.grad_accum or spg) if spg and double else None, target,
                            clipped, launch_bound, suggest_vllm, m.steady_step_sec, m.weight_sync_share,
                            m.rollout_tokens_per_sec, clipped >= CLIPPED_LARGE)
    advice = (suggest_vllm, backend == "vllm-server", facts.optimizer_steps_per_rollout, target, facts.clipped_large)
    if not any(advice):                          # the facts hold nothing to advise
        return None
    return finding("generation_bound", "launch_bound" if launch_bound else "generation_share", facts,
                   setting, None, "low", "try", None, stake_sec=m.phase_sec.get("generation"))


@card(finding=f"GRPO with vLLM: weight syncs ≥ {WEIGHT_SYNC_SHARE:.0%} of the wall time → `steps_per_generation` "
              "×2 (one sync per generation; with its cost: later updates learn off-policy), the server near the "
              "trainer",
      gain="no")
def rule_weight_sync(m: Measurements) -> Finding | None:
    share = m.weight_sync_share
    if not m.grpo or share is None or share < WEIGHT_SYNC_SHARE or _too_short(m):
        return None
    backend = m.generation_backend or "vllm"
    spg = m.steps_per_generation or m.grad_accum
    setting: Setting = {"steps_per_generation": 2 * spg} if spg and not _under_pressure(m) else {}
    if backend == ASYNC:                         # the trainer sends its weights every weight_sync_steps steps
        setting = {"weight_sync_steps": 2 * m.weight_sync_steps} if m.weight_sync_steps else {}
    if not setting and backend != "vllm-server":
        return None
    return finding("weight_sync", "sync_share",
                   WeightSync(share, m.weight_syncs, m.weight_sync_sec, backend, _phase(m, "generation"), spg,
                              backend == "vllm-colocate" and bool(m.vllm_enable_sleep_mode), m.weight_sync_steps),
                   setting, None, "medium", "try", None, stake_sec=share * m.wall_sec if m.wall_sec else None)


@card(finding=f"async GRPO: the trainer waits for rollouts ≥ {ROLLOUT_WAIT_SHARE:.0%} of the wall time → more "
              "generation (vLLM engines, `max_inflight_tasks`), `max_staleness` (with its cost: more off-policy)",
      gain="no")
def rule_rollout_wait(m: Measurements) -> Finding | None:
    wait = _phase(m, "rollout_wait")
    if not m.grpo or m.generation_backend != ASYNC or wait < ROLLOUT_WAIT_SHARE or _too_short(m):
        return None
    return finding("rollout_wait", "waits_for_rollouts", RolloutWait(wait, m.staleness_mean), {}, None, "medium",
                   "try", None, stake_sec=wait * m.wall_sec if m.wall_sec else None)


@card(finding=f"GRPO: the reward functions ≥ {REWARD_SHARE:.0%} of the wall time (`perf/phase_sec/reward`, measured) "
              "→ `steps_per_generation` ×2 (half the reward calls, each scoring twice the completions; with its "
              "cost: later updates learn off-policy), scoring the completions of a call together, `async def` for "
              "rewards that wait (TRL runs them concurrently)",
      gain="no: the run does not tell a reward's cost per call from its cost per completion")
def rule_reward(m: Measurements) -> Finding | None:
    """GRPO's reward functions take a large share of the run: fewer, larger calls, batched or concurrent scoring."""
    wall, seconds = float(m.wall_sec or 0.0), m.phase_sec.get("reward", 0.0)
    if not m.grpo or wall <= 0 or seconds / wall < REWARD_SHARE or not m.reward_calls:
        return None
    spg = m.steps_per_generation or m.grad_accum
    setting: Setting = {"steps_per_generation": 2 * spg} if spg and not _under_pressure(m) else {}
    facts = RewardShare(seconds, wall, m.reward_calls, m.reward_completions,
                        tuple(m.rewards.funcs) if m.rewards else (), spg)
    return finding("reward", "reward_share", facts, setting, None, "medium", "try", None, stake_sec=seconds)


def _cut_off(m: Measurements, seen: CompletionLengths, clipped: float) -> Finding:
    """Most completions end at ``max_completion_length``: a quality finding naming the limit and the masking."""
    raised = _raised_limit(m, seen.limit, clipped)
    headroom = bool(m.mem_high_water_gb is not None and m.mem_budget_gb
                    and m.mem_high_water_gb < HIGH_WATER_FRACTION * m.mem_budget_gb)
    setting: Setting = {"max_completion_length": raised.new} if headroom else {"mask_truncated_completions": True}
    return finding("completion_budget", "cut_off", CutOff(seen, clipped, raised, headroom), setting, None, "medium",
                   "try", None)


@card(finding="GRPO: most completions cut at `max_completion_length` → the limit, `mask_truncated_completions`; "
              "rare runaways reach a limit far above use → a cap",
      gain="no",
      note="no runaways (memory only)")
def rule_completion_budget(m: Measurements) -> Finding | Note | None:
    limit = m.max_completion_length
    if not m.grpo or not limit:
        return None
    clipped = m.clipped_ratio
    seen = CompletionLengths(limit, clipped, m.completion_mean, m.completion_p90, m.completion_max)
    if clipped is not None and clipped >= CLIPPED_LARGE:
        return _cut_off(m, seen, clipped)
    target = _completion_target(m)
    if not target:
        return None
    facts = Runaways(seen, target, clipped or 0.0, _memory_freed_by_cut(m, limit, target.new), COMPLETION_HEADROOM)
    if facts.clipped <= 0 or _phase(m, "generation") <= 0:
        return note("completion_budget", "no_runaways", facts)
    return finding("completion_budget", "runaways", facts, {"max_completion_length": target.new}, None, "low", "try",
                   None)


def _constant_reward(r: Rewards) -> bool:
    """Every completion of the run scored the same: the mean reward never moved and no group had any spread."""
    return (r.max - r.min <= ZERO and (r.std_max or 0.0) <= ZERO
            and (r.zero_std_min is None or r.zero_std_min >= 1.0 - 1e-9))
