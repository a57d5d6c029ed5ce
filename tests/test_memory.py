"""Pure memory policy: levels with hysteresis, trend and steps to the wall, leak detection, the ladder, and the
cache-clear back-off — exact values, no trainer."""
import pytest

from hf_perf_callbacks.memory import (
    CLEAR,
    CRITICAL,
    OK,
    SMALLER_BATCH,
    STOP,
    WARN,
    ClearSchedule,
    MemoryPolicy,
    Observation,
)

MB = 1024**2


def policy(**kw):
    return MemoryPolicy(**{"budget": 1000.0, "grace_steps": 0, "trend_window": 4, "warn_within_steps": 0,
                           "stop_within_steps": 0, "leak_min_growth": 1.0, **kw})


def test_levels_rise_at_thresholds_and_fall_with_hysteresis():
    p = policy(warn_fraction=0.9, hysteresis=0.05)
    assert p.observe(Observation(1, 899)) == OK
    assert p.observe(Observation(2, 900)) == WARN
    assert p.observe(Observation(3, 860)) == WARN        # still above 900 - 50
    assert p.observe(Observation(4, 849)) == OK
    assert p.observe(Observation(5, 1000)) == CRITICAL
    assert p.observe(Observation(6, 960)) == CRITICAL    # above 1000 - 50
    assert p.observe(Observation(7, 949)) == WARN


def test_macos_signals_set_the_level():
    p = policy()
    assert p.observe(Observation(1, 10, os_level=2)) == WARN
    assert p.observe(Observation(2, 10, os_level=4)) == CRITICAL
    assert p.observe(Observation(3, 10, os_level=1, swapouts=0)) == OK
    assert p.observe(Observation(4, 10, os_level=1, swapouts=50)) == WARN       # swapping has begun
    assert p.observe(Observation(5, 10, os_level=1, swapouts=80)) == CRITICAL   # and goes on
    assert p.observe(Observation(6, 10, os_level=1, swapouts=0)) == OK
    assert p.observe(Observation(7, 10, alloc_retries=3)) == WARN               # CUDA allocator thrash


def test_trend_predicts_steps_to_wall_exactly():
    p = policy()
    for step, used in [(1, 100), (2, 200), (3, 300), (4, 400)]:
        p.observe(Observation(step, used))
    assert p.slope == pytest.approx(100)
    assert p.steps_to_wall == pytest.approx(6.0)          # (1000 - 400) / 100
    flat = policy()
    for step in range(1, 5):
        flat.observe(Observation(step, 500))
    assert flat.steps_to_wall is None


def test_leak_needs_growth_on_every_step_after_grace():
    p = policy(grace_steps=1, trend_window=4)
    for step, used in enumerate([100, 110, 120, 130], start=1):
        p.observe(Observation(step, used))
    assert p.leaking
    q = policy(trend_window=4)
    for step, used in enumerate([100, 110, 110, 130], start=1):
        q.observe(Observation(step, used))
    assert not q.leaking                                  # one flat step: not a steady leak


def test_ladder_clear_then_smaller_batch_then_stop():
    p = policy()
    p.observe(Observation(1, 1000))                       # critical
    order = []
    for _ in range(4):
        action = p.next_action(can_shrink=True)
        if action is None:
            break
        p.taken(action)
        order.append(action)
    assert order == [CLEAR, SMALLER_BATCH, STOP]


def test_warn_without_tuner_only_clears_and_stop_needs_urgency():
    p = policy()
    p.observe(Observation(1, 950))                        # warn
    assert p.next_action(can_shrink=False) == CLEAR
    p.taken(CLEAR)
    assert p.next_action(can_shrink=False) is None        # warn alone never stops training


def test_wall_within_stop_steps_stops_before_crossing():
    p = policy(stop_within_steps=3, warn_within_steps=10)
    for step, used in enumerate([500, 600, 700], start=1):
        p.observe(Observation(step, used))
    assert p.level == OK and p.steps_to_wall == pytest.approx(3.0)
    assert p.next_action(can_shrink=False) == CLEAR
    p.taken(CLEAR)
    assert p.next_action(can_shrink=False) == STOP


def test_grace_steps_suppress_actions():
    p = policy(grace_steps=2)
    p.observe(Observation(1, 2000))
    assert p.level == CRITICAL and p.next_action(True) is None
    p.observe(Observation(2, 2000))
    assert p.next_action(True) is None
    p.observe(Observation(3, 2000))
    assert p.next_action(True) == CLEAR


def test_episode_resets_when_back_to_ok():
    p = policy()
    p.observe(Observation(1, 950))
    p.taken(p.next_action(False))
    p.observe(Observation(2, 100))
    p.observe(Observation(3, 950))
    assert p.next_action(False) == CLEAR                  # a new episode starts from the first rung


@pytest.mark.parametrize("kw, name", [({"budget": 0}, "budget"), ({"warn_fraction": 1.5}, "warn_fraction"),
                                      ({"trend_window": 2}, "trend_window"), ({"grace_steps": -1}, "grace_steps")])
def test_policy_validates(kw, name):
    with pytest.raises(ValueError, match=name):
        policy(**kw)


def test_clear_schedule_backs_off_and_comes_back():
    s = ClearSchedule(interval=4, min_interval=2, max_interval=16, min_freed=100)
    assert not s.due(3) and s.due(4)
    s.cleared(4, freed=10)
    assert s.interval == 8                                # freed little: back off
    s.cleared(12, freed=50)
    assert s.interval == 16
    s.cleared(28, freed=10)
    assert s.interval == 16                               # capped
    s.cleared(44, freed=400)
    assert s.interval == 8                                # freed a lot: come back
    s.cleared(50, freed=10, automatic=False)              # requested clears do not move the interval
    assert s.interval == 8 and s.last_clear_step == 50
    assert not s.gap_ok(51) and s.gap_ok(52)
    with pytest.raises(ValueError, match="interval_steps"):
        ClearSchedule(interval=1, min_interval=2)


# ---------------------------------------------------------------- steps_to_wall with its 95% range

from hf_perf_callbacks.stats import steps_to_limit  # noqa: E402
from hf_perf_callbacks.watchdog import wall_fields  # noqa: E402


def test_forecast_is_absent_when_memory_is_flat_or_shrinking():
    assert steps_to_limit([1, 2, 3, 4], [5.0, 5.0, 5.0, 5.0], 10.0) is None
    assert steps_to_limit([1, 2, 3, 4], [5.0, 4.9, 4.8, 4.7], 10.0) is None
    assert wall_fields(None, 100) == {}


def test_exact_linear_growth_gives_a_range_of_one_point():
    f = steps_to_limit([1, 2, 3, 4], [10.0, 12.0, 14.0, 16.0], 30.0)
    assert f.steps == pytest.approx(7.0) and f.low == 7.0 and f.high == 7.0


def test_noisy_growth_gives_a_range_around_the_point():
    f = steps_to_limit([1, 2, 3, 4], [10.0, 12.0, 13.5, 16.0], 40.0)
    assert f.low < f.steps < f.high


def test_growth_that_may_be_zero_has_no_upper_bound():
    f = steps_to_limit([1, 2, 3, 4], [10.0, 14.0, 13.0, 14.5], 40.0)
    assert f is not None and f.high is None and f.low <= f.steps


def test_wall_beyond_the_run_is_not_logged_and_the_high_end_is_capped():
    f = steps_to_limit([1, 2, 3, 4], [0.0, 1.0, 2.0, 3.0], 4.2e6)   # slow growth: millions of steps away
    assert wall_fields(f, remaining=50) == {}
    near = steps_to_limit([1, 2, 3, 4], [10.0, 14.0, 13.0, 14.5], 40.0)
    fields = wall_fields(near, remaining=int(near.steps) + 2)
    assert fields["mem/steps_to_wall_high"] == int(near.steps) + 2     # no bound within the interval: capped
    assert set(wall_fields(near, remaining=None)) == {"mem/steps_to_wall", "mem/steps_to_wall_low"}


def planted_leak_forecasts(seed, window=4, headroom=3 * 1024.0, mean=128.0, max_steps=80, base=1000.0):
    """The planted-leak benchmark's process (benchmarks/bench_watchdog.py): each step keeps a block of
    uniform(0.5, 1.5) × mean bytes. Returns (point error, range holds the truth) for every logged forecast, the
    truth being the steps until the planted schedule crosses the budget."""
    import random

    rng = random.Random(seed)
    sizes = [mean * rng.uniform(0.5, 1.5) for _ in range(max_steps)]
    budget = base + headroom
    policy = MemoryPolicy(budget=budget, trend_window=window, warn_within_steps=6, stop_within_steps=3)
    used, out = base, []
    for step in range(1, max_steps + 1):
        used += sizes[step - 1]
        policy.observe(Observation(step, used))
        fields = wall_fields(policy.forecast(), max_steps - step)
        if "mem/steps_to_wall" in fields:
            total, k = used, 0
            while total < budget and step + k < max_steps:
                total += sizes[step + k]
                k += 1
            if total >= budget and k > 0:
                held = fields["mem/steps_to_wall_low"] <= k <= fields.get("mem/steps_to_wall_high", float("inf"))
                out.append((abs(fields["mem/steps_to_wall"] - k) / k, held))
        if used >= budget:
            break
    return out


def test_the_range_holds_the_true_steps_to_wall_in_nine_of_ten_seeds_on_the_planted_leak():
    per_seed = [planted_leak_forecasts(seed) for seed in range(20)]
    forecasts = [f for seed in per_seed for f in seed]
    coverage = sum(held for _, held in forecasts) / len(forecasts)
    seeds_held = sum(sum(held for _, held in seed) >= 0.9 * len(seed) for seed in per_seed)
    errors = sorted(e for e, _ in forecasts)
    # the point estimate from 4 steps cannot be within 20% at p90 (the leak's own randomness: at 1-3 steps from the
    # wall one step is 33-100%); the range holds the truth in ≥ 90% of the forecasts of ≥ 18 of the 20 seeds
    assert len(forecasts) > 300 and coverage >= 0.9 and seeds_held >= 18
    print(f"\nplanted leak, 20 seeds, {len(forecasts)} forecasts: range coverage {coverage:.1%}, seeds with ≥ 90% "
          f"{seeds_held}/20, point error median {errors[len(errors) // 2]:.0%}, p90 "
          f"{errors[int(0.9 * (len(errors) - 1))]:.0%}")


def test_the_budget_is_the_fraction_of_the_smallest_real_limit_or_the_given_limit():
    from hf_perf_callbacks.memory import budget_bytes

    gib = 2**30
    assert budget_bytes("cuda", 80 * gib, None, 512 * gib) == 0.85 * 80 * gib       # RAM is no limit of a GPU
    assert budget_bytes("mps", 20 * gib, 30 * gib, 16 * gib, budget_fraction=0.5) == 8 * gib   # unified memory
    assert budget_bytes("cpu", None, None, 24 * gib) == 0.85 * 24 * gib
    assert budget_bytes("cuda", 80 * gib, None, None, limit_gb=12) == 12 * gib
    with pytest.raises(ValueError, match="no memory limit known for device type 'xpu': pass limit_gb"):
        budget_bytes("xpu", None, None, None)
