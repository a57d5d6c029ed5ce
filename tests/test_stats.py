"""Pure math: warmup detection on synthetic traces, windowed rates, and line fits."""
import pytest

from hf_perf_callbacks.core.stats import WarmupDetector, WindowedRate, generation_period, linear_fit


def feed(detector, values):
    for i, v in enumerate(values):
        if detector.add(v):
            return i
    return None


def test_warmup_ends_where_every_later_step_is_in_the_steady_band():
    trace = [7.3, 2.0, 1.05, 1.0, 1.0, 1.02, 0.98, 1.0]
    d = WarmupDetector(window=4, tolerance=0.1, max_warmup=50)
    decided_at = feed(d, trace)
    assert decided_at == 7                       # needs 2 × window samples
    assert d.warmup_samples == 2                 # from 1.05 on, every step is below 1.0 × 1.1
    assert not d.add(100.0)                      # decided once, then fixed


def test_first_step_7x_slower():
    # field report, a GRPO run on a Mac: first batch 29.6 s, then ~4 s per step
    trace = [29.6] + [4.0 + 0.05 * (i % 3) for i in range(12)]
    d = WarmupDetector(window=4, tolerance=0.05)
    feed(d, trace)
    assert d.warmup_samples == 1


def test_jittery_steps_still_end_warmup():
    # GRPO's launch-bound generation: ±20% jitter after a 3x first step; a 10% band alone would never close
    jitter = [1.0, 1.2, 0.85, 1.15, 0.9, 1.25, 0.8, 1.1, 0.95, 1.2, 0.85, 1.05]
    d = WarmupDetector(window=4, tolerance=0.1)
    feed(d, [3.0] + jitter)
    assert d.done and d.warmup_samples == 1


def test_a_still_falling_step_time_is_not_steady():
    d = WarmupDetector(window=4, tolerance=0.1, max_warmup=50)
    assert feed(d, [10.0 - 0.8 * i for i in range(10)]) is None
    assert feed(WarmupDetector(window=3, tolerance=0.1), [100.0 - 5 * i for i in range(10)]) is None


def test_already_warm_process_has_zero_warmup():
    d = WarmupDetector(window=3, tolerance=0.1)
    feed(d, [1.0, 1.01, 0.99, 1.0, 1.0, 1.01])
    assert d.warmup_samples == 0


def test_a_trace_that_never_settles_hits_the_cap():
    trace = [100.0 - 5 * i for i in range(19)]   # falls by 5% or more every step
    d = WarmupDetector(window=3, tolerance=0.1, max_warmup=5)
    decided_at = feed(d, trace)
    assert d.warmup_samples == 5
    assert decided_at == 10                      # cap + 2 windows of samples


@pytest.mark.parametrize("kwargs, name", [({"window": 1}, "warmup_window"), ({"tolerance": 0}, "warmup_tolerance"),
                                          ({"tolerance": 1.5}, "warmup_tolerance"),
                                          ({"max_warmup": -1}, "max_warmup_steps"),
                                          ({"window": 2.5}, "warmup_window")])
def test_detector_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WarmupDetector(**kwargs)


def test_windowed_rate_uses_whole_periods_only():
    # GRPO with a generation every 2 optimizer steps: all tokens land on the generation step.
    r = WindowedRate(window=3, period=2)
    assert r.size == 4
    r.add(1000, 1.0)
    assert r.rate() is None                      # half a period: no spiky number
    r.add(0, 1.0)
    assert r.rate() == 500.0
    r.add(1000, 1.0)
    assert r.rate() == 500.0                     # still only the first whole period
    r.add(0, 1.0)
    assert r.rate() == 500.0
    r.add(3000, 1.0)                             # window slides to [0, 1000, 0, 3000]: any 4 consecutive steps
    assert r.rate() == pytest.approx(4000 / 4)   # hold exactly 2 generation steps, so no spike
    r.add(0, 1.0)                                # [1000, 0, 3000, 0]
    assert r.rate() == pytest.approx(4000 / 4)


def test_generation_period():
    assert generation_period(2, 1, 2) == 1       # spg == GA: every step generates
    assert generation_period(4, 1, 2) == 2       # generation every other optimizer step
    assert generation_period(2, 2, 2) == 2       # num_iterations 2 replays each generation twice
    assert generation_period(2, 1, 4) == 1       # two generations per optimizer step


def test_linear_fit_exact():
    slope, intercept = linear_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)
    assert linear_fit([1, 1], [2, 4]) == (0.0, 3.0)
    with pytest.raises(ValueError):
        linear_fit([1], [1])


def test_classify_slow_steps_splits_excess_wall_time_into_warmup_and_contention():
    from hf_perf_callbacks.core.stats import classify_slow_steps

    slow = classify_slow_steps([4.0, 3.0, 1.0, 1.0, 1.0, 1.0], [1.5, 0.5, 0.5, 0.5, 0.5, 0.5], 1.0, 0.5)
    assert slow.labels == ["warmup", "contention", "steady", "steady", "steady", "steady"]
    assert slow.contention_sec == pytest.approx(1.0 + 2.0)      # the first step: 2 of its 3 s excess were warmup
    with pytest.raises(ValueError, match="equal-length"):
        classify_slow_steps([1.0], [], 1.0, 0.5)


def test_mann_whitney_exact_values_and_large_samples():
    from hf_perf_callbacks.core.stats import mann_whitney_less

    assert mann_whitney_less([1, 2, 3], [4, 5, 6]) == pytest.approx(1 / 20)
    assert mann_whitney_less([1, 2], [1, 2]) == pytest.approx(5 / 6)      # ties count half
    assert mann_whitney_less(list(range(10)), list(range(10, 20))) < 1e-3  # normal approximation
    assert mann_whitney_less(list(range(10, 20)), list(range(10))) > 0.99


def test_quantile_and_iqr():
    from hf_perf_callbacks.core.stats import iqr, quantile

    assert quantile([1, 2, 3, 4, 5], 0.5) == 3 and iqr([1, 2, 3, 4, 5]) == (2, 4)
    assert quantile([1.0, 2.0], 0.25) == pytest.approx(1.25)
