"""Step accounting with explicit timestamps (a patched clock): exact phase times, windows, warmup, resume."""
import pytest

from hf_perf_callbacks.core.timeline import StepTimeline


def run_step(tl, step, t, *, wait=0.0, gen=0.0, compute=1.0, tokens=100, eval_s=0.0, save_s=0.0):
    """Drive one optimizer step starting at time t (its batches clocked as data wait); returns (record, end time)."""
    tl.enter("data_wait", t)
    t += wait
    tl.leave("data_wait", t)
    tl.step_begin(t)
    tl.add_generation(gen)
    t += gen + compute
    record = tl.commit(tl.measure(step, t), tokens)
    if eval_s:
        t += eval_s
        tl.mark("eval", t)
    if save_s:
        t += save_s
        tl.mark("save", t)
    return record, t


def test_phases_are_exact_and_eval_save_leave_training_time():
    tl = StepTimeline(window_steps=2, warmup_window=2, warmup_tolerance=0.1)
    tl.start_segment(0.0)
    r1, t = run_step(tl, 1, 0.0, wait=0.5, gen=2.0, compute=1.0, eval_s=4.0, save_s=1.5)
    assert (r1.wall, r1.train, r1.data_wait, r1.generation, r1.compute) == (3.5, 3.5, 0.5, 2.0, 1.0)
    r2, t = run_step(tl, 2, t, wait=0.25, gen=2.0, compute=1.0)
    # step 2's record covers the eval and save that ran after step 1 ended
    assert (r2.eval, r2.save, r2.data_wait) == (4.0, 1.5, 0.25)
    assert r2.wall == pytest.approx(4.0 + 1.5 + 0.25 + 3.0)
    assert r2.train == pytest.approx(3.25)
    assert tl.tokens_per_sec == pytest.approx(200 / (3.5 + 3.25))
    shares = tl.take_window_phases()
    total = 3.5 + r2.wall
    assert shares["eval"] == pytest.approx(4.0 / total) and shares["generation"] == pytest.approx(4.0 / total)
    assert tl.take_window_phases() == dict.fromkeys(shares, 0.0)   # reset per logging interval


def test_warmup_then_steady_rate_excludes_warmup_steps():
    tl = StepTimeline(window_steps=10, warmup_window=3, warmup_tolerance=0.05)
    tl.start_segment(0.0)
    t = 0.0
    for step, compute in enumerate([5.0, 2.0, 1.0, 1.0, 1.0, 1.0], start=1):
        _, t = run_step(tl, step, t, compute=compute, tokens=100)
    assert tl.warmup_done and tl.warmup_steps == 2
    assert tl.warmup_overhead == pytest.approx((5 - 1) + (2 - 1))
    assert tl.first_step_slowdown == pytest.approx(5.0)
    assert tl.steady_tokens_per_sec == pytest.approx(100.0)       # 4 steady steps, 400 tokens, 4 s
    assert tl.tokens_per_sec == pytest.approx(600 / 11)           # the window still holds warmup


def test_grpo_period_detects_on_cycles_and_counts_steps():
    # generation every 2 steps: a long step (with all the tokens) then a short one
    tl = StepTimeline(window_steps=4, warmup_window=4, warmup_tolerance=0.1, max_warmup_steps=20)
    tl.start_segment(0.0, period=2)
    t = 0.0
    pattern = [(9.0, 1000), (1.0, 0), (3.0, 1000), (1.0, 0)] + [(3.0, 1000), (1.0, 0)] * 4
    for step, (compute, tokens) in enumerate(pattern, start=1):
        _, t = run_step(tl, step, t, compute=compute, tokens=tokens)
        if step % 2 == 1:
            assert tl.tokens_per_sec is None or tl.tokens_per_sec == pytest.approx(250.0)  # never a spike
    assert tl.warmup_steps == 2                                  # one cycle of 2 steps
    assert tl.first_step_slowdown == pytest.approx(10.0 / 4.0)
    assert tl.steady_tokens_per_sec == pytest.approx(250.0)


def test_resume_segment_keeps_totals_and_does_not_spike():
    tl = StepTimeline(window_steps=2, warmup_window=2, warmup_tolerance=0.1)
    tl.start_segment(0.0)
    t = 0.0
    for step in range(1, 5):
        _, t = run_step(tl, step, t, compute=1.0, tokens=100)
    saved = tl.export()
    resumed = StepTimeline(window_steps=2, warmup_window=2, warmup_tolerance=0.1)
    resumed.load(saved)
    resumed.start_segment(1000.0)                # a new process, much later
    assert resumed.tokens_per_sec is None        # no window spanning the gap
    _, t = run_step(resumed, 5, 1000.0, compute=1.0, tokens=100)
    assert resumed.tokens_per_sec == pytest.approx(100.0)
    assert resumed.steps == 5 and resumed.total_tokens == 500
    assert resumed.steady_tokens_per_sec == pytest.approx(100.0)


def test_generation_outside_a_step_is_not_training_time():
    tl = StepTimeline()
    tl.start_segment(0.0)
    tl.add_generation(5.0)                       # eval-time generation
    tl.step_begin(0.0)
    record = tl.commit(tl.measure(1, 1.0), 10)
    assert record.generation == 0.0 and record.compute == 1.0


def test_bad_phase_and_parameters():
    tl = StepTimeline()
    with pytest.raises(ValueError, match="phase='log'"):
        tl.mark("log", 1.0)
    with pytest.raises(ValueError, match="window_steps"):
        StepTimeline(window_steps=0)
    with pytest.raises(ValueError, match="period"):
        tl.start_segment(0.0, period=0)


def run_cpu_steps(walls, cpus, window=2):
    """CPU mode: each step takes ``wall`` seconds of which the process used ``cpu`` CPU seconds."""
    tl = StepTimeline(window_steps=10, warmup_window=window, warmup_tolerance=0.1)
    t = cpu_t = 0.0
    tl.start_segment(t, cpu=cpu_t, work="cpu")
    for step, (wall, cpu) in enumerate(zip(walls, cpus), start=1):
        tl.step_begin(t)
        t, cpu_t = t + wall, cpu_t + cpu
        tl.commit(tl.measure(step, t, cpu=cpu_t), 100)
    return tl


def test_slow_early_steps_with_flat_cpu_time_are_contention_not_warmup():
    tl = run_cpu_steps([5.0, 5.0, 1.0, 1.0, 1.0, 1.0], [0.5] * 6)
    assert tl.warmup_done and tl.warmup_steps == 0 and tl.warmup_overhead == 0.0
    assert tl.early_contention == pytest.approx(8.0)               # (5 - 1) × 2 s: other processes
    assert tl.contention_steps == [1, 2]
    # the contended steps are steady (their work was): the steady figures count them, in wall time, not CPU time
    assert tl.steady_step_seconds == pytest.approx(14.0 / 6)
    assert tl.steady_tokens_per_sec * tl.steady_step_seconds == pytest.approx(100.0)


def test_slow_early_steps_with_more_cpu_time_are_warmup():
    tl = run_cpu_steps([5.0, 3.0, 1.0, 1.0, 1.0, 1.0], [2.5, 1.5, 0.5, 0.5, 0.5, 0.5])
    assert tl.warmup_steps == 2 and tl.early_contention == pytest.approx(0.0)
    assert tl.warmup_overhead == pytest.approx((5 - 1) + (3 - 1))  # extra CPU seconds × 2 wall s per CPU s
    assert tl.export()["early_contention"] == 0.0


def test_wall_mode_and_a_missing_cpu_reading_detect_on_wall_time():
    tl = StepTimeline(warmup_window=2)
    tl.start_segment(0.0, cpu=None, work="cpu")
    assert tl.work == "wall"
    with pytest.raises(ValueError, match="work='gpu'"):
        tl.start_segment(0.0, cpu=0.0, work="gpu")


def test_cpu_mode_reports_the_first_step_slowdown_in_wall_time():
    # the first step: 1.5 s of wall time with 3 CPU seconds behind it; steady steps 1 s of wall and CPU time
    tl = run_cpu_steps([1.5, 1.0, 1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert tl.warmup_steps == 1 and tl.steady_step_seconds == pytest.approx(1.0)
    assert tl.first_step_slowdown == pytest.approx(1.5)           # wall / steady wall, not 3.0 (CPU / steady CPU)
    assert tl.warmup_overhead == pytest.approx(0.5)                # the excess wall time, all explained by CPU time


def test_cpu_mode_splits_one_excess_into_warmup_and_contention_and_keeps_both_over_a_resume():
    # step 1: 4 s above the steady 1 s with 0.5 extra CPU seconds (= 1 wall second at 2 wall s per CPU s) behind it
    tl = run_cpu_steps([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert tl.warmup_steps == 1
    assert tl.warmup_overhead == pytest.approx(1.0) and tl.early_contention == pytest.approx(3.0)
    saved = tl.export()
    assert saved["early_contention"] == pytest.approx(3.0)
    tl.start_segment(100.0, cpu=100.0, work="cpu")                 # a new segment keeps the earlier split
    assert tl.warmup_overhead == pytest.approx(1.0) and tl.early_contention == pytest.approx(3.0)
    resumed = StepTimeline()
    resumed.load(saved)
    resumed.start_segment(0.0, cpu=0.0, work="cpu")
    assert resumed.warmup_overhead == pytest.approx(1.0) and resumed.early_contention == pytest.approx(3.0)


def test_one_definition_each_steady_rate_times_steady_step_is_the_tokens_of_a_steady_step():
    # seen: "2 tok/s · 112 s/step" (the step the median of one window, the rate the mean over all steady steps)
    tl = StepTimeline(window_steps=10, warmup_window=2, warmup_tolerance=0.3)
    tl.start_segment(0.0)
    t = 0.0
    for step, (compute, tokens) in enumerate([(6.0, 100), (1.0, 100), (1.0, 200), (1.2, 100), (0.9, 300),
                                              (1.1, 100)], start=1):
        _, t = run_step(tl, step, t, compute=compute, tokens=tokens)
    assert tl.warmup_steps == 1 and tl.first_steady_step == 2 and tl.steady_steps == 5
    assert tl.steady_step_seconds == pytest.approx((1.0 + 1.0 + 1.2 + 0.9 + 1.1) / 5)
    assert tl.steady_tokens_per_sec == pytest.approx(800 / 5.2)
    assert tl.steady_tokens_per_sec * tl.steady_step_seconds == pytest.approx(800 / 5)   # tokens per steady step
    assert tl.first_step_slowdown == pytest.approx(6.0 / (5.2 / 5))                  # against that same step time


def test_the_first_steady_step_is_the_decisions_not_the_step_it_was_decided_at():
    tl = StepTimeline(window_steps=10, warmup_window=3, warmup_tolerance=0.05)
    tl.start_segment(0.0)
    t = 0.0
    decided = None
    for step, compute in enumerate([5.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0], start=1):
        _, t = run_step(tl, step, t, compute=compute)
        if decided is None and tl.warmup_done:
            decided = step
    assert tl.first_steady_step == 3 and decided == 6          # decided three steps after warmup ended
    saved = tl.export()
    resumed = StepTimeline(window_steps=10, warmup_window=3, warmup_tolerance=0.05)
    resumed.load(saved)
    resumed.start_segment(100.0)
    assert resumed.first_steady_step is None and resumed.steady_steps == 5      # a new segment decides anew
    assert resumed.steady_step_seconds == pytest.approx(1.0)


def test_cpu_mode_counts_no_warmup_overhead_for_steady_steps():
    # the detector calls every step steady on CPU time (warmup 0); a loaded machine made the first steps slow with
    # some extra CPU time: that is steady jitter or contention, never overhead of a warmup that took 0 steps
    tl = run_cpu_steps([6.0, 5.0] + [1.0] * 6, [0.65, 0.62, 0.42, 0.55, 0.5, 0.58, 0.5, 0.5], window=4)
    assert tl.warmup_steps == 0 and tl.warmup_overhead == 0.0      # was 0.54 s "above steady time" in 0 steps
    assert tl.early_contention == pytest.approx(8.46) and tl.contention_steps == [1, 2]
