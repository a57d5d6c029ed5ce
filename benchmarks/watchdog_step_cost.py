"""What a MemoryWatchdog costs a training step, clocked directly: runs of ``bench_tuner.py``'s GRPO+LoRA trainer (GPU:
a Qwen2.5-0.5B-shaped model, 32×1, completions of 16 tokens; CPU: the tiny demo's trainer, 8×1) one after another
on one device, plain (A) and with a watchdog (B), in the order ``--order`` (default ABBA). Each run's figures a step
after step 15: the time in the trainer's callback handler (every event, every callback), in the watchdog's memory
readings and in its check before each step (inside the batch fetch), and in Python's garbage collections; and its
median seconds outside ``generate``, for scale only: runs of one kind on one card differ by tens of percent from
run to run, which is why the cost is clocked and not read from step times.

``--alternate N``: one run with a watchdog instead, in blocks of N steps after the warm-up by turns: A the watchdog
disabled (its hooks return at once), B working, C working on its last memory reading again (no device call), so
that every state sees the same card and drift; per state the median seconds outside ``generate`` of its steps, and
per cycle the difference of the block medians B − A and C − A. Writes ``results/watchdog_step_cost_<card>.json``
(``_alternating`` with ``--alternate``)."""
import argparse
import gc
import statistics
import time

from bench_tuner import WallSteps, card_name, make_trainer
from common import release, table, write_result
from transformers import TrainerCallback

from hf_perf_callbacks import MemoryWatchdog
from hf_perf_callbacks.platform.device import DeviceLayer

SKIP = 15                                       # steps left out at the start (warm-up)


class Clocks:
    """Seconds spent in wrapped callables, by name, and in garbage collections (``gc.callbacks``)."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - started
        setattr(owner, name, timed)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.spent["garbage collection"] = self.spent.get("garbage collection", 0.0) + \
                time.perf_counter() - self._gc_start


class Snapshots(WallSteps):
    """bench_tuner's step timer, keeping the clocks at every step end."""

    def __init__(self, clocks: Clocks):
        super().__init__()
        self.clocks, self.snapshots = clocks, []

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.snapshots.append(dict(self.clocks.spent))


def one_run(a, clocks: Clocks, watchdog: bool) -> dict:
    timer = Snapshots(clocks)
    callbacks = [timer] + ([MemoryWatchdog()] if watchdog else [])
    trainer = make_trainer(a, callbacks, (8, 1) if a.tiny else (32, 1), a.steps)
    clocks.wrap(trainer.callback_handler, "call_event", "callback handler")
    if watchdog:
        clocks.wrap(callbacks[-1], "_before_step", "watchdog's check before a step")
    trainer.train()
    first, last = timer.snapshots[SKIP], timer.snapshots[-1]
    steps = len(timer.snapshots) - 1 - SKIP
    outside = [w - g for w, g in zip(timer.walls, timer.generation)][SKIP:]
    release(trainer)
    return {"watchdog": watchdog, "steps": steps,
            "ms_a_step": {k: (last[k] - first.get(k, 0.0)) / steps * 1e3 for k in last},
            "median_outside_generation_ms": statistics.median(outside) * 1e3}


class Alternation(TrainerCallback):
    """Sets the state of the next step (see the module docstring); it comes after the timer and before the
    watchdog, so the watchdog's step end runs in, and is timed with, the step it is set for."""

    def __init__(self, watchdog: MemoryWatchdog, block: int):
        self.watchdog, self.block, self.states, self.reuse = watchdog, block, ["B"], False
        self._last = None
        original = DeviceLayer.memory

        def memory(layer):
            if not (self.reuse and self._last is not None):
                self._last = original(layer)
            return self._last
        DeviceLayer.memory = memory

    def on_step_end(self, args, state, control, **kwargs):
        upcoming = state.global_step + 1
        turn = (upcoming - SKIP - 1) // self.block if upcoming > SKIP else None
        now = "B" if turn is None else "ABC"[turn % 3]
        self.watchdog.disabled, self.reuse = now == "A", now == "C"
        self.states.append(now)


def alternating(a, clocks: Clocks) -> dict:
    timer = Snapshots(clocks)
    watchdog = MemoryWatchdog()
    turns = Alternation(watchdog, a.alternate)
    clocks.wrap(DeviceLayer, "memory", "memory readings")
    trainer = make_trainer(a, [timer, turns, watchdog], (8, 1) if a.tiny else (32, 1), a.steps)
    trainer.train()
    outside = [w - g for w, g in zip(timer.walls, timer.generation)]
    release(trainer)
    states = turns.states[:len(outside)]
    by_state = {s: [o for o, t in zip(outside[SKIP:], states[SKIP:]) if t == s] for s in "ABC"}
    blocks: list[tuple[str, float]] = []
    for start in range(SKIP, len(outside), a.alternate):
        chunk = outside[start:start + a.alternate]
        if len(chunk) == a.alternate:
            blocks.append((states[start], statistics.median(chunk)))
    cycles = [dict(blocks[i:i + 3]) for i in range(0, len(blocks) - 2, 3)]
    result = {"block_steps": a.alternate, "states": {"A": "watchdog disabled", "B": "watchdog working",
                                                     "C": "watchdog working on its last memory reading"},
              "median_outside_generation_ms": {s: statistics.median(v) * 1e3 for s, v in by_state.items() if v},
              "cycles_ms": [{k: v * 1e3 for k, v in c.items()} for c in cycles],
              "b_minus_a_ms": statistics.median([(c["B"] - c["A"]) * 1e3 for c in cycles]) if cycles else None,
              "c_minus_a_ms": statistics.median([(c["C"] - c["A"]) * 1e3 for c in cycles]) if cycles else None,
              "step_states": states, "step_outside_generation": outside}
    medians = result["median_outside_generation_ms"]
    print(table(["state", "median outside generate ms", "steps"],
                [[result["states"][s], medians.get(s), len(by_state[s])] for s in "ABC"]))
    print(f"per cycle (median of {len(cycles)}): B - A {result['b_minus_a_ms']} ms, C - A {result['c_minus_a_ms']} ms")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--order", default="ABBA", help="A: a plain run, B: a run with a MemoryWatchdog")
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="the tiny demo's trainer on the CPU (a check of the script)")
    p.add_argument("--alternate", type=int, default=0, help="one run, the watchdog's states by turns, N steps each")
    a = p.parse_args()
    if set(a.order) - {"A", "B"} or not a.order:
        raise SystemExit(f"--order {a.order!r}: A (plain) and B (with a watchdog) only")
    if a.steps <= SKIP + 1:
        raise SystemExit(f"--steps {a.steps}: more than {SKIP + 1} steps, the first {SKIP} are a warm-up")
    a.smoke = a.full = False
    a.model = "qwen05"
    clocks = Clocks()
    if a.alternate:
        if a.alternate < 3:
            raise SystemExit(f"--alternate {a.alternate}: blocks of 3 steps at least")
        write_result(f"watchdog_step_cost_{card_name()}_alternating",
                     {"alternating": alternating(a, clocks), "settings": vars(a)})
        return
    clocks.wrap(DeviceLayer, "memory", "memory readings")
    runs = [one_run(a, clocks, kind == "B") for kind in a.order]
    plain = [r["ms_a_step"].get("callback handler", 0.0) for r in runs if not r["watchdog"]]
    base = statistics.median(plain) if plain else 0.0
    for r in runs:
        ms = r["ms_a_step"]
        r["watchdog_ms_a_step"] = (ms.get("callback handler", 0.0) - base
                                   + ms.get("watchdog's check before a step", 0.0)) if r["watchdog"] else 0.0
    print(table(["run", "watchdog ms a step", "its memory readings ms", "callbacks ms", "gc ms", "outside generate ms"],
                [[i + 1 if not r["watchdog"] else f"{i + 1} (watchdog)", r["watchdog_ms_a_step"],
                  r["ms_a_step"].get("memory readings", 0.0), r["ms_a_step"].get("callback handler", 0.0),
                  r["ms_a_step"].get("garbage collection", 0.0), r["median_outside_generation_ms"]]
                 for i, r in enumerate(runs)]))
    write_result(f"watchdog_step_cost_{card_name()}", {"runs": runs, "settings": vars(a)})


if __name__ == "__main__":
    main()
