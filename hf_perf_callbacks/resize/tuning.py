"""Tuning on the run's own steps: which exact split to measure next, when a switch can pay back, and what the
evidence says. Pure: numbers in, actions out (no torch, no transformers, no clock).

**Measure on steps the run trains anyway.** The split in effect (the *baseline*) is measured on the run's first
steps. A candidate split is tried on the following training steps — the run switches to it at a step boundary
(GRPO: a generation boundary) through the in-process re-size, exact in samples and effective batch — and is kept
when it is faster beyond the noise, left otherwise. Steps trained during tuning count toward ``max_steps``: nothing
is trained twice, nothing is thrown away.

**Evidence.** Each split is ranked by its step time outside generation (``rank_by="non_generation"``: the
generation batch is the same for every split, and HF ``generate`` jitters by tens of percent) or by the whole step.
The run's first ``WARMUP_AT_START`` generation cycles, and the first ``WARMUP_AFTER_SWITCH`` after a switch, are a
warm-up and are not measured (they are trained like any step); the warm-up at the start is fixed, never ended early
by two steps that agree (docs/tuning.md has the H200 run that showed why). The configured split is measured on
``first_samples`` steps (``FIRST_SAMPLES``) before the first candidate is tried. After each measured generation cycle
of a candidate the *sequential test* (:func:`sequential`) decides at once when the gap between the extremes of the
two splits' steps is beyond the noise (the pooled spread of the log step times, at least ``SIGMA_FLOOR``, at
``ALPHA_SEQUENTIAL`` over the candidate's looks), so that a split 8× slower or faster is decided on its first
measured step and one stray step never decides. Otherwise the candidate is judged after each block of ``samples``
measured steps against all of the baseline's samples (:func:`judge`: one-sided Mann-Whitney ``p <= ALPHA /
max_rounds`` and a median at least ``MIN_GAIN`` shorter); on equal splits with 20% noise, noise alone keeps another
split in under 10% of runs (``tests/test_tuning.py``). Not yet separable: another round, back to the baseline for a
block and to the candidate again (interleaved, so that a drift of the machine hits both), while rounds are
affordable; a candidate that runs out of memory or passes the memory budget is left at once. Every figure is the
slowest rank's, gathered: every rank decides alike.

**Cost before you pay.** A trial's cost is its switches (:meth:`OnRunTuning.switch_cost`: measured on this run once
one happened, reckoned before), the warm-up after each switch, the slower steps of a worse candidate and the switch
back when it is left. A round starts only when the saving it can plausibly make over the steps left *after* it
exceeds its cost (twice over, ``PRIOR_MARGIN``, while no switch of the run has been measured;
:meth:`OnRunTuning.saving_figures` says how the saving is reckoned). A run too short to pay back tries nothing and
costs nothing.

**Order.** Larger micro-batches first, the largest first (on accelerators the largest split that fits is usually
the fastest, and trying it first spends the fewest steps at slower splits): one that runs out of memory or passes
the memory budget is left for the next largest; the walk up ends at the first one kept, or after ``patience`` left
as not faster. When none was kept, smaller ones, nearest first (a kept one becomes the baseline and the walk goes
on from it), until ``patience`` in a row were not kept.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from ..core.batching import Split
from ..core.splitfile import RANKED_WORDS, Decision, Trial
from ..core.stats import iqr, mann_whitney_less, median
from ..core.validation import check_flag, check_number
from ..core.wording import TUNER_ENDED_WORDS, Figure, tuner_reason, tuning_outcome

#: a trial's ``error`` when its peak memory passed the budget (a caller's words otherwise: "out of memory")
OVER_BUDGET = "peak memory over the budget"
#: one-sided significance level of "faster than the baseline"
ALPHA = 0.05
#: the least relative saving (of the ranked time) worth keeping a candidate
MIN_GAIN = 0.03
#: fewer samples per split cannot separate two splits (3 against 3: p = 1/20 at best)
MIN_SAMPLES = 3
#: measured steps per split and round by default (4 against 4: p = 1/70 at best, below ALPHA / 3 rounds)
SAMPLES = 4
#: the rate at which a switch is assumed to write and read the training state, until a switch was measured (bytes/s)
SAVE_BYTES_PER_SEC = 200e6
#: the least a switch is assumed to cost beyond the run's first-step overhead until one of the run's was measured: a
#: checkpoint, the end of a train() call and the start of the next (measured: the quick start's tiny model on this
#: project's idle 2-core CPU 1.8 s, 5.7–7.2 s at a load of 7; LoRA on an H100 0.8–1.4 s, on the CPU 0.87 s,
#: ``benchmarks/results/tuner_switch*.json``)
SWITCH_FLOOR_SEC = 2.0
#: until one of the run's switches was measured, a round must plausibly save this many times its reckoned cost: the
#: reckoning is a prior, seen off by more (the quick start's switches: 1.8 s idle, 7-10 s at a load of 6-7)
PRIOR_MARGIN = 2.0
#: generation cycles not measured at the run's start (first kernels, allocator growth, dataloader workers: seen on an
#: H100 as outside-generation times of 4.3, 4.2, 2.2, 2.2 s over the first steps of a 4×8 run settling at 2 s)
WARMUP_AT_START = 3
#: cycles not measured after a switch (the new micro-batch's first shapes)
WARMUP_AFTER_SWITCH = 2
#: measured steps of the configured split before the first candidate is tried (rounded up to whole generation
#: cycles): each costs a step at a split that may be the slow one (from a 7.8× slower start, 2 instead of 4 samples
#: save 2 slow steps); a candidate near it gets interleaved rounds, which measure the baseline further
FIRST_SAMPLES = 2
#: the sequential test's chance of deciding wrongly over all of one candidate's looks, each way (Bonferroni)
ALPHA_SEQUENTIAL = 0.01
#: the least spread (standard deviation of the log step time) the sequential test assumes of a split's steady steps:
#: 15% a step (the H100 GRPO+LoRA runs' blocks spread 0.22-0.41 with a stray step; planted runs have none)
SIGMA_FLOOR = 0.15


def judge(candidate: list[float], baseline: list[float], alpha: float = ALPHA) -> tuple[float, float, bool]:
    """``(p, gain, faster)`` of a candidate's samples against the baseline's: one-sided Mann-Whitney ``p``, the
    relative saving of the median ``gain``, and whether both clear ``alpha`` and ``MIN_GAIN``."""
    p = mann_whitney_less(candidate, baseline)
    base = median(baseline)
    gain = 1.0 - median(candidate) / base if base > 0 else 0.0
    return p, gain, p <= alpha and gain >= MIN_GAIN


@dataclass
class Evidence:
    """What the sequential test (:func:`sequential`) saw after one look: ``verdict`` ``"faster"``, ``"slower"`` or
    None (keep sampling); ``ratio``: the baseline's fastest step over the candidate's slowest (``faster``: above 1
    when every candidate step was faster) and ``slower_ratio``: the candidate's fastest over the baseline's slowest;
    ``bound``: the ratio beyond which either is decided (the noise allowed; ``faster`` also needs ``MIN_GAIN``);
    ``spread``: the log step time's standard deviation assumed; ``error``: this look's chance of a wrong verdict."""

    verdict: str | None
    ratio: float
    slower_ratio: float
    bound: float
    spread: float
    error: float

    def figures(self, candidate: object, baseline: object, prefix: str = "") -> dict[str, Figure]:
        """Its figures (and the two splits' labels), each key under ``prefix``: what a typed reason carries."""
        return {prefix + k: v for k, v in (("candidate", str(candidate)), ("baseline", str(baseline)),
                                           ("ratio", self.ratio), ("slower_ratio", self.slower_ratio),
                                           ("bound", self.bound), ("spread", self.spread), ("error", self.error),
                                           ("min_gain", MIN_GAIN))}


#: the expected range of n normal samples in standard deviations (d2), for the spread of fewer than four samples
_RANGE_SD = {2: 1.128, 3: 1.693}


def spread_width(values: Sequence[float]) -> float:
    """The width of the samples' interquartile range, from four samples up; below that, the range's estimate of it
    (1.349 standard deviations, the standard deviation from the range): the quartiles of two or three samples
    understate the spread (two give half their range, where the interquartile range is 1.2 times it)."""
    if len(values) >= 4:
        low, high = iqr(values)
        return high - low
    if len(values) < 2:
        return 0.0
    return 1.349 * (max(values) - min(values)) / _RANGE_SD[len(values)]


def log_spread(groups: Sequence[Sequence[float]]) -> float:
    """The pooled standard deviation of the log step times of ``groups`` (each split's samples about its own mean;
    non-positive times left out), at least :data:`SIGMA_FLOOR`."""
    squares, freedom = 0.0, 0
    for group in groups:
        logs = [math.log(x) for x in group if x > 0]
        if len(logs) > 1:
            mean = sum(logs) / len(logs)
            squares += sum((v - mean) ** 2 for v in logs)
            freedom += len(logs) - 1
    return max(SIGMA_FLOOR, math.sqrt(squares / freedom) if freedom else 0.0)


def sequential(candidate: Sequence[float], baseline: Sequence[float], spread: float, looks: int,
               alpha: float = ALPHA_SEQUENTIAL) -> Evidence:
    """One look of the sequential test of a candidate's samples against the baseline's (pure: figures in, verdict
    out; every rank gets the same from the same gathered figures).

    In log time, ``gap = log min(baseline) - log max(candidate)`` (faster) or ``log min(candidate) -
    log max(baseline)`` (slower) is decided when it exceeds ``t = z × spread × √(1/n_b + 1/n_c)`` (faster: plus
    ``-log(1 - MIN_GAIN)``), ``z`` the normal quantile of ``1 - alpha / looks``. Error bound: the extremes' gap is at
    most the means' gap, so where a split's log step times spread normally by ``spread`` and the candidate is not
    faster by ``MIN_GAIN`` (not slower), a look says ``faster`` (``slower``) with a chance of at most
    ``alpha / looks``, and at most ``alpha`` over ``looks`` looks. Non-positive times decide nothing."""
    if not candidate or not baseline or min(candidate) <= 0 or min(baseline) <= 0:
        return Evidence(None, 0.0, 0.0, math.inf, spread, 0.0)
    error = alpha / max(1, looks)
    t = NormalDist().inv_cdf(1 - error) * spread * math.sqrt(1 / len(baseline) + 1 / len(candidate))
    bound = math.exp(t)
    ratio, slower_ratio = min(baseline) / max(candidate), min(candidate) / max(baseline)
    verdict = ("faster" if ratio >= bound / (1 - MIN_GAIN) else "slower" if slower_ratio >= bound else None)
    return Evidence(verdict, ratio, slower_ratio, bound, spread, error)


@dataclass
class Switch:
    """Run the next steps at ``split`` (the loop re-sizes at this step boundary)."""

    split: Split
    why: str


@dataclass(frozen=True)
class Why:
    """Why the tuning ended or left a candidate, as data: ``code`` (one of :data:`~hf_perf_callbacks.core.wording.
    TUNER_REASONS`) and the figures it rests on; its words are
    :func:`~hf_perf_callbacks.core.wording.tuner_reason`'s."""

    code: str
    figures: dict[str, Figure] = field(default_factory=dict)

    def __str__(self) -> str:
        return tuner_reason(self.code, self.figures)


@dataclass
class Finished:
    """Tuning is over: ``split`` is the one to keep (the loop switches back to it when another runs now); ``reason``
    in words, rendered from ``outcome`` (``kept_configured``, ``faster_beyond_noise``), ``ended`` (why it ended: a
    :class:`Why`) and ``figures`` (what the outcome rests on)."""

    split: Split
    reason: str
    outcome: str = "kept_configured"
    ended: Why | None = None
    figures: dict[str, Figure] = field(default_factory=dict)


class OnRunTuning:
    """The tuning state of one run (see the module docstring). The caller reports every train() call's start
    (:meth:`segment_started`) and every optimizer step's measurement (:meth:`observe`), and acts on what they
    return."""

    def __init__(self, baseline: Split, candidates: list[Split], planned_steps: int | None, period: int = 1,
                 samples: int = SAMPLES, max_rounds: int = 3, patience: int = 1, must_pay: bool = True,
                 state_bytes: float = 0.0, rank_by: str = "non_generation", first_samples: int = FIRST_SAMPLES):
        check_number("samples", samples, low=MIN_SAMPLES, integer=True)
        check_number("first_samples", first_samples, low=2, high=samples, integer=True)
        check_number("max_rounds", max_rounds, low=1, integer=True)
        check_number("patience", patience, low=1, integer=True)
        check_number("period", period, low=1, integer=True)
        check_number("planned_steps", planned_steps, low=0, integer=True, allow_none=True)
        check_flag("must_pay", must_pay)
        self.period, self.planned = period, planned_steps
        self.samples = -(-samples // period) * period            # whole generation cycles
        self.first = -(-first_samples // period) * period         # the configured split's first block
        self.max_rounds, self.patience, self.must_pay = max_rounds, patience, must_pay
        self.state_bytes, self.rank_by = state_bytes, rank_by
        self.start = baseline                                     # the split tuning started from
        self.baseline = baseline
        self.trials: dict[Split, Trial] = {baseline: Trial(baseline)}
        self.larger = sorted((c for c in candidates if c.micro_batch > baseline.micro_batch),
                             key=lambda s: -s.micro_batch)
        self.smaller = sorted((c for c in candidates if c.micro_batch < baseline.micro_batch),
                              key=lambda s: -s.micro_batch)
        self.walk = "larger"
        self.misses = 0
        self.current = baseline
        self.candidate: Split | None = None
        self.rounds = 0
        self.block: list[float] = []           # this block's samples
        self.warm_left = 0
        self.first_step: float | None = None   # the whole time of this run's first step (its restart overhead)
        self.switch_seconds: list[float] = []
        self.cost = 0.0                        # spent beyond training: switches, warm-up excess, slower steps
        self.done: Finished | None = None
        self.recorded = False                  # the tune decision was recorded
        self.note: Why | None = None           # why tuning stopped (for the decision's reason)
        self.kept_by: dict[Split, tuple[Split, dict[str, Figure]]] = {}   # a split the sequential test kept:
        #                                        against what, its evidence's figures

    # ------------------------------------------------------------ what the caller reports
    def segment_started(self, split: Split, step: int, switch_sec: float | None = None) -> None:
        """A train() call begins at ``step`` with ``split`` in effect; ``switch_sec``: what the switch into it cost
        (from the request to this call's first step)."""
        self.current = split
        self.trials.setdefault(split, Trial(split))
        self.block = []
        cycles = WARMUP_AFTER_SWITCH if switch_sec is not None else WARMUP_AT_START
        self.warm_left = (self.period - step % self.period) % self.period + cycles * self.period
        needed = self.warm_left + self._trial_steps()                  # a baseline block and one trial
        if self.must_pay and self.planned is not None and self.planned - step < needed \
                and not self.trials[self.start].samples:
            self._finish(Why("too_short", {"needed": needed, "left": max(0, self.planned - step)}))
            return
        if switch_sec is not None:
            self.switch_seconds.append(switch_sec)
            self.cost += switch_sec
            self.trials[split].cost_sec += switch_sec

    def failed(self, split: Split, why: str, step: int) -> Split:
        """``split`` ran out of memory at ``step``: it is left (a larger one that does not fit makes way for the
        next largest). Returns the split the run resumes with: the next candidate when one is affordable (its trial
        starts at once), else the baseline (and the tuning ends)."""
        trial = self.trials.setdefault(split, Trial(split))
        trial.fits, trial.error = False, why
        self.candidate, self.rounds, self.block = None, 0, []
        if self.walk == "smaller":
            self.misses += 1
        self.note = Why("failed", {"candidate": str(split), "why": why})
        following = self._next_candidate(step)
        if following is not None:
            return following.split
        self._finish(self.note)
        return self.baseline

    def observe(self, step: int, ranked: float, whole: float, peak_gb: float | None = None,
                fits: bool = True) -> Switch | Finished | None:
        """One optimizer step ``step`` measured at the current split (the slowest rank's seconds); what to do."""
        if self.done is not None:
            return None
        trial = self.trials[self.current]
        if peak_gb is not None:
            trial.peak_gb = max(trial.peak_gb or 0.0, peak_gb)
        if self.first_step is None:
            self.first_step = whole
        if self.warm_left > 0:                     # the first cycles after a (re)start: a warm-up, not a sample
            self._warm_up(trial, whole)
            return None
        self._sample(trial, step, ranked, whole)
        if self.current == self.candidate:
            action = self._judge_candidate(step, trial, ranked, fits, self.current)
            if action is not None:
                return action
        if len(self.block) < (self.first if self.candidate is None else self.samples):
            return None
        return self._block_done(step)

    def _warm_up(self, trial: Trial, whole: float) -> None:
        """A warm-up step: not a sample; what it cost beyond a measured step is the switch's."""
        self.warm_left -= 1
        if self.switch_seconds and self.trials[self.baseline].samples:
            excess = max(0.0, whole - median(self.trials[self.baseline].step_samples or [whole]))
            self.cost += excess
            trial.cost_sec += excess

    def _judge_candidate(self, step: int, trial: Trial, ranked: float, fits: bool,
                         candidate: Split) -> Switch | Finished | None:
        """A sample of the candidate: its cost over the baseline booked; left when over budget or slower, kept when
        faster (judged over whole generation cycles); None: go on sampling."""
        slower = max(0.0, ranked - median(self.trials[self.baseline].samples))
        self.cost += slower
        trial.cost_sec += slower
        if not fits:
            trial.fits, trial.error = False, OVER_BUDGET
            return self._leave(step, Why("over_budget", {"candidate": str(candidate)}), memory=True)
        if len(self.block) % self.period:          # not a whole generation cycle: no switch yet
            return None
        spread = log_spread([t.samples for t in self.trials.values()])      # pooled over every split measured
        looks = self.max_rounds * (self.samples // self.period)            # one per generation cycle of every round
        evidence = sequential(trial.samples, self.trials[self.baseline].samples, spread, looks)
        if evidence.verdict == "slower":
            return self._leave(step, Why("slower", evidence.figures(candidate, self.baseline)))
        if evidence.verdict == "faster":
            self.kept_by[candidate] = (self.baseline, evidence.figures(candidate, self.baseline, "seq_"))
            return self._keep(step, candidate)
        return None

    def _sample(self, trial: Trial, step: int, ranked: float, whole: float) -> None:
        trial.samples.append(ranked)
        trial.step_samples.append(whole)
        trial.steps.append(step)
        self.block.append(ranked)

    # ------------------------------------------------------------ decisions
    def _block_done(self, step: int) -> Switch | Finished | None:
        self.block = []
        if self.candidate is None:                 # the baseline's first block: choose the first candidate
            return self._next_candidate(step) or self._finish(self.note)
        if self.current != self.baseline:          # a block of the candidate: judged against all of the baseline's
            candidate, base = self.trials[self.candidate], self.trials[self.baseline]
            candidate.p_value, candidate.gain, faster = judge(candidate.samples, base.samples, ALPHA / self.max_rounds)
            self.rounds += 1
            if faster:
                return self._keep(step, self.candidate)
            if self.rounds >= self.max_rounds:
                return self._leave(step, Why("not_faster", {"candidate": str(self.candidate), "rounds": self.rounds}))
        if not self._affordable(step):
            return self._leave(step, Why("not_separable", {"candidate": str(self.candidate)}))
        if self.current == self.baseline:          # an interleaving block of the baseline: the candidate again
            return Switch(self.candidate, "measuring again (interleaved)")
        return Switch(self.baseline, "measuring the baseline again (interleaved)")

    def _keep(self, step: int, kept: Split) -> Switch | Finished:
        if self.walk == "larger":                  # the largest faster split that fits: the walk up ends, and no
            self.larger = []                       # smaller one is tried
            self.smaller = []
        self.baseline, self.candidate, self.rounds = kept, None, 0
        self.misses = 0
        return self._next_candidate(step) or self._finish(self.note)

    def _leave(self, step: int, why: Why, memory: bool = False) -> Switch | Finished:
        self.candidate, self.rounds, self.block = None, 0, []
        if not (memory and self.walk == "larger"):   # too large for memory: the next largest may fit
            self.misses += 1
        self.note = why
        following = self._next_candidate(step)
        if following is not None:
            return following
        if self.current != self.baseline:          # the switch back is part of the trial's cost (estimated: the run
            back = self.switch_cost()               # records the tuning before that switch is made)
            self.cost += back
            self.trials[self.current].cost_sec += back
            self.done = self._verdict(why)
            return Switch(self.baseline, f"back to {self.baseline}: {why}")
        return self._finish(why)

    def _next_candidate(self, step: int | None) -> Switch | None:
        """Start the next affordable trial, or None (no candidate left, or none can pay back)."""
        if self.walk == "larger" and (not self.larger or self.misses >= self.patience):
            self.walk, self.misses, self.larger = "smaller", 0, []
            self.smaller = [s for s in self.smaller if s.micro_batch < self.baseline.micro_batch]   # nearest first
        queue = self.larger if self.walk == "larger" else self.smaller
        if self.misses >= self.patience:
            queue.clear()
        if not queue:
            self.note = self.note or Why("no_other_split")
            return None
        if step is not None and not self._affordable(step):
            self.note = self._cannot_pay_note(step)
            return None
        self.candidate = queue.pop(0)
        self.rounds = 0
        return Switch(self.candidate, "trying a split on the next steps")

    def end(self, reason: str) -> None:
        """End the tuning now at its baseline (memory or the run's end ended it), for ``reason``: a code of
        :data:`~hf_perf_callbacks.core.wording.TUNER_ENDED_WORDS` or their words (other words: code ``ended``)."""
        words = {w: c for c, w in TUNER_ENDED_WORDS.items()}
        code = reason if reason in TUNER_ENDED_WORDS else words.get(reason, "ended")
        why = Why(code, {} if code != "ended" else {"why": reason})
        self.done = Finished(self.baseline, str(why), "kept_configured", why)

    def _finish(self, reason: Why | None) -> Finished:
        self.done = self._verdict(reason)
        return self.done

    def _verdict(self, note: Why | None) -> Finished:
        """The tuning's outcome: the kept split's evidence against the starting one (over all the samples of both,
        as every reader of the record prints it), then why it ended; its words rendered from these figures."""
        start, kept = self.trials[self.start], self.trials[self.baseline]
        words = str(note) if note is not None else ""
        if self.baseline == self.start or not (start.samples and kept.samples):
            return Finished(self.baseline, tuning_outcome("kept_configured", {}, words), "kept_configured", note)
        figures: dict[str, Figure] = {"kept": str(self.baseline), "start": str(self.start),
                                      "median_kept": median(kept.samples), "median_start": median(start.samples),
                                      "steps_kept": len(kept.samples), "steps_start": len(start.samples)}
        against, evidence = self.kept_by.get(self.baseline, (None, {}))
        if against == self.start:                  # kept at once by the sequential test: its evidence
            figures.update(evidence)
        else:
            figures["p"] = mann_whitney_less(kept.samples, start.samples)
        return Finished(self.baseline, tuning_outcome("faster_beyond_noise", figures, words), "faster_beyond_noise",
                        note, figures)

    # ------------------------------------------------------------ cost against gain
    def switch_cost(self) -> float:
        """Seconds one switch costs: the mean of this run's measured switches, else the run's own first-step
        overhead (over the baseline's step: a switch starts a train() call anew) plus writing and reading the
        training state, at least :data:`SWITCH_FLOOR_SEC` for the latter."""
        if self.switch_seconds:
            return sum(self.switch_seconds) / len(self.switch_seconds)
        steady = self.trials[self.start].step_samples
        overhead = max(0.0, (self.first_step or 0.0) - median(steady)) if steady else 0.0
        return overhead + max(SWITCH_FLOOR_SEC, 2 * self.state_bytes / SAVE_BYTES_PER_SEC)

    def round_cost(self) -> float:
        """A round's cost: a switch there and one back, and the candidate's block of steps at the noise (the
        baseline's interquartile range a step: a candidate within the noise may as well be that much slower)."""
        base = self.trials[self.baseline].samples
        return 2 * self.switch_cost() + self.samples * spread_width(base)

    def _trial_steps(self) -> int:
        """Steps of one block after a switch: its warm-up and its samples."""
        return WARMUP_AFTER_SWITCH * self.period + self.samples

    def _steps_left_after_round(self, step: int) -> int | None:
        if self.planned is None:
            return None
        return self.planned - step - 2 * self._trial_steps()

    def saving_figures(self) -> tuple[float, dict[str, Figure]]:
        """(seconds per step a round can plausibly save, the figures of how that was reckoned: ``how`` "measured"
        or "ceiling"), at the spread of the samples measured so far:

        - before the candidate is measured: the baseline's median ranked time (the ceiling: a split with no
          split-dependent time) less the baseline's interquartile range — the candidate's steps carry the machine's
          noise too, so the part of the time within that spread cannot be told from the noise in a round;
        - once it is measured: its median gain over the baseline plus the standard error of that difference
          (0.93 × the two interquartile ranges averaged × √(1/n_baseline + 1/n_candidate)): the most its samples
          still allow. A candidate that cannot pay for another round even at that gain is left.
        """
        base = self.trials[self.baseline].samples
        trial = self.trials.get(self.candidate) if self.candidate is not None else None
        candidate = trial.samples if trial is not None else []
        width = spread_width(base)
        if candidate:
            centre = median(base) - median(candidate)
            error = 0.93 * (width + spread_width(candidate)) / 2 * math.sqrt(1 / len(base) + 1 / len(candidate))
            return max(0.0, centre + error), {"how": "measured", "candidate": str(self.candidate),
                                              "baseline": str(self.baseline), "gain": centre, "std_error": error}
        return max(0.0, median(base) - width), {"how": "ceiling", "baseline": str(self.baseline),
                                                "median": median(base), "iqr": width}

    def _affordable(self, step: int) -> bool:
        if not self.must_pay:                      # try every split, whatever it costs (benchmarks, tests)
            return True
        left = self._steps_left_after_round(step)
        if left is None or left <= 0:
            return False
        return left * self.saving_figures()[0] > self.round_cost() * self._margin()

    def _margin(self) -> float:
        return 1.0 if self.switch_seconds else PRIOR_MARGIN

    def _cannot_pay_note(self, step: int) -> Why:
        left = self._steps_left_after_round(step)
        if left is None or self.planned is None:   # one is None when the other is
            return Why("unknown_length")
        if left <= 0:
            return Why("round_too_long", {"round_steps": 2 * self._trial_steps(), "left": max(0, self.planned - step)})
        saving, how = self.saving_figures()
        return Why("cannot_pay_back", {**how, "saving": saving, "steps_after": left, "margin": self._margin(),
                                       "cost": self.round_cost()})

    # ------------------------------------------------------------ the record
    def decision(self, step: int, time: float | None) -> Decision | None:
        """The finished tuning as its one ``tune`` decision, taken at ``step`` (at ``time``): every split measured,
        the tuning's cost and its expected gain over the rest of the run. Given once: None before the tuning
        finished and after the decision was taken."""
        if self.done is None or self.recorded:
            return None
        self.recorded = True
        return Decision(kind="tune", step=step, reason=self.done.reason, old=self.start, new=self.done.split,
                        time=time, trials=self.trial_list(), cost_sec=self.cost,
                        expected_gain_sec=self.expected_gain_sec(step), planned_steps=self.planned, rule=self.rule(),
                        reason_code=self.done.outcome, ended_by=self.done.ended.code if self.done.ended else None,
                        figures={**(self.done.ended.figures if self.done.ended else {}), **self.done.figures},
                        rank_by="step" if self.rank_by == "step" else "non_generation")

    def expected_gain_sec(self, step: int) -> float | None:
        start, kept = self.trials[self.start].samples, self.trials[self.baseline].samples
        if self.planned is None or not start or not kept:
            return None
        return max(0, self.planned - step) * (median(start) - median(kept))

    def rule(self) -> str:
        ranked = RANKED_WORDS["step" if self.rank_by == "step" else "non_generation"]
        return (f"keep a split only when it is faster than the baseline by one-sided Mann-Whitney p <= {ALPHA} / "
                f"{self.max_rounds} rounds and a median at least {MIN_GAIN:.0%} shorter ({ranked}), measured on the "
                f"run's own steps, or at once when its slowest step is faster than the baseline's fastest beyond the "
                f"noise (sequential, error <= {ALPHA_SEQUENTIAL} over its looks; leave it at once when slower so); "
                f"try one only when the rest of the run can pay its switches back")

    def leave_out(self, splits: Collection[Split]) -> None:
        """Never try ``splits`` (shown not exact for the run after the tuning was planned)."""
        self.larger = [s for s in self.larger if s not in splits]
        self.smaller = [s for s in self.smaller if s not in splits]

    def trial_list(self) -> list[Trial]:
        """Every split measured, the starting one first; each measured one's ``gain`` and ``p_value`` against the
        starting split over all the samples of both (the figures every reader of the record prints, not those of
        the round that judged it)."""
        start = self.trials[self.start]
        others = [t for s, t in self.trials.items() if s != self.start]
        for t in others:
            if t.samples and start.samples:
                t.p_value, t.gain, _ = judge(t.samples, start.samples)
        return [start] + others
