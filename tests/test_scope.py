"""Advice that knows what it measured on: a run of ``hf-perf train`` on another model, device or completion length
than its recipe was written for says so at the top of its report, and advises no setting that undoes a memory choice
of the recipe; every finding carries the model, device and lengths it was measured on; MFU says what it is against
(on a CPU calibrated: per CPU second, which other processes do not move)."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import Trainer

from hf_perf_callbacks import ThroughputMeter, keys
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.core.wording import MFU_BASIS_SHORT, mfu_words
from hf_perf_callbacks.platform.device import DeviceLayer
from hf_perf_callbacks.report import summarize
from hf_perf_callbacks.report.model import RecipeTarget
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.render import console_summary, render_markdown
from hf_perf_callbacks.report.rules import check, scope_of
from hf_perf_callbacks.report.words import scope_words, stand_in_words
from hf_perf_callbacks.train import arguments, recipes
from tests.conftest import PlantedClock, make_trainer
from tests.test_analysis import healthy
from tests.test_recipes import launcher_process as launcher_process  # the fixtures of the launcher's tests
from tests.test_recipes import recipe_flags
from tests.test_recipes import tiny_model as tiny_model

RECIPE = "mac-16gb-qwen1.5b"


def test_a_stand_in_run_of_a_recipe_says_so_first_and_keeps_the_recipes_memory_choices(tiny_model, tmp_path,
                                                                                         launcher_process):
    """The recipe trial a CPU machine can run (the recipe, a local model for its Qwen, the CPU for its Mac, 8-token
    completions for its 128): the launcher records the recipe's target in the run header, the report names the
    stand-in at its top and in every finding, and none of its settings turns off the recipe's gradient checkpointing
    or raises its micro-batch or completion length."""
    from hf_perf_callbacks import train

    out = tmp_path / "out"
    assert train.main(recipe_flags(RECIPE, tiny_model, out)) == 0
    recipe = arguments.read_recipe(recipes.path(RECIPE))
    header = read_run(str(out)).header()
    assert header.target == {"recipe": RECIPE, "machine": recipes.describe(RECIPE)["machine"], "device_type": "mps",
                             "model": recipe["model_name_or_path"],
                             "max_completion_length": recipe["max_completion_length"],
                             "memory": {k: recipe[k] for k in ("activation_checkpointing",
                                                               "per_device_train_batch_size",
                                                               "max_completion_length", "num_generations", "dtype",
                                                               "use_peft")}}
    m = measurements_from_run(str(out))
    scope = scope_of(m)
    assert scope.stand_in == ("model", "device", "completions") and m.model_name == tiny_model
    findings, notes = check(m)
    scoped = {n.reason: n for n in notes if n.rule == "scope"}
    assert "stand_in" in scoped
    if "kept_for_recipe" in scoped and scoped["kept_for_recipe"].facts.rule == "recompute":   # the field report's
        assert scoped["kept_for_recipe"].facts.undone[0][:2] == ("activation_checkpointing", True)   # case, if seen
    for f in findings:
        assert f.scope == scope
        assert f.setting.get("activation_checkpointing", True) is True
        assert f.setting.get("per_device_train_batch_size", 0) <= recipe["per_device_train_batch_size"]
        assert f.setting.get("max_completion_length", 0) <= recipe["max_completion_length"]
    text = render_markdown(findings, m, notes)              # its words: golden/rules.md, "stand_in"
    top, said = text.split("\n## ", 1)[0], stand_in_words(scoped["stand_in"].facts)
    assert said in top and RECIPE in said and recipe["model_name_or_path"] in said
    assert all(scope_words(scope) in block.lower() for block in text.split("\n## ")[1:] if block[0].isdigit())
    console = console_summary(findings, notes=notes).splitlines()        # its first line, wrapped at 160
    assert console[1].startswith("stand-in run:") and said in " ".join(line.strip() for line in console[1:4])


def test_recompute_advice_on_a_stand_in_becomes_a_note_naming_the_recipes_choice():
    """seen: the recipe trial (SmolLM2-135M for Qwen2.5-1.5B, the CPU for a 16 GB Mac, completions 32 for 128) printed
    "Gradient checkpointing recomputes with memory to spare — ≥ 1.23x" and `activation_checkpointing: false` for a
    recipe whose checkpointing is what keeps a Mac from swapping. The same measurements of the recipe's own model
    and machine keep the finding."""
    target = RecipeTarget(RECIPE, "Apple Silicon, 16 GB of unified memory", "mps", "Qwen/Qwen2.5-1.5B-Instruct", 128,
                          {"activation_checkpointing": True, "per_device_train_batch_size": 2})
    own = healthy(device_type="cpu", activation_checkpointing=True, recompute_clocked=True, wall_sec=100.0,
                  phase_sec={"recompute": 20.0, "compute": 80.0}, mem_high_water_gb=1.0, mem_budget_gb=80.0,
                  micro_batch=1, grad_accum=8, seq_len=64,
                  model_name="smollm2-135m", target=target, max_completion_length=32)
    stand_in = {f.rule for f in check(own)[0]}
    notes = {n.reason: n for n in check(own)[1]}
    assert "recompute" not in stand_in and "kept_for_recipe" in notes
    kept = notes["kept_for_recipe"]
    assert kept.facts.undone == (("activation_checkpointing", True, False),) and kept.facts.target == target
    same = dataclasses.replace(own, device_type="mps", model_name=target.model, max_completion_length=128)
    assert scope_of(same).stand_in == () and "recompute" in {f.rule for f in check(same)[0]}


def test_mfu_on_a_calibrated_cpu_is_per_cpu_second_and_other_processes_do_not_move_it(tokenizer, tmp_path,
                                                                                       one_thread, monkeypatch):
    """seen: on a shared CPU the calibrated peak is measured under the same contention, so MFU read 38.7% while the
    process got a quarter of a core, and 6.7% at 2,534 tok/s beside 6.4% at 6,440. Per CPU second the figure is the
    same whatever the wall time other processes take: here a run whose every step also waits 20 wall seconds without
    CPU time (another process holding the core) reads the MFU of the run without them, at a fraction of its tokens/s.
    Every second is planted (the calibration: 1 wall second, a quarter of a core; a step: 1 CPU second), so the
    machine's own load moves neither figure."""
    def run(out, wait):
        clock = PlantedClock(cpu_only_planted=True, wall_only_planted=True)

        def calibrate_flops(self, dtype):
            clock.spend(1.0)
            clock.spend_cpu(0.25)
            return 4e9

        class Waiting(Trainer):
            def training_step(self, *args, **kwargs):
                clock.spend_cpu(1.0)
                clock.spend(1.0 + wait)
                return super().training_step(*args, **kwargs)

        monkeypatch.setattr(DeviceLayer, "calibrate_flops", calibrate_flops)
        make_trainer(tokenizer, out, [ThroughputMeter(clock=clock, peak_flops="calibrate")], max_steps=12, bs=4, ga=1,
                     trainer_cls=Waiting, length=32).train()
        return read_run(str(out))

    free, held = run(tmp_path / "free", 0.0), run(tmp_path / "held", 20.0)
    for r in (free, held):
        header, summary = r.header("perf"), r.summary("perf")
        assert header.mfu_basis == "cpu_time" and header.peak_flops_per_cpu_sec == pytest.approx(4e9 / 0.25)
        assert summary["mfu"] > 0
    rate = held.summary("perf")["steady_tokens_per_sec"] / free.summary("perf")["steady_tokens_per_sec"]
    assert rate == pytest.approx(1 / 21)                                     # the wall-time figure collapses ...
    assert held.summary("perf")["mfu"] == pytest.approx(free.summary("perf")["mfu"])    # ... MFU does not move
    m = measurements_from_run(str(tmp_path / "held"))
    assert m.mfu_basis == "cpu_time" and MFU_BASIS_SHORT["cpu_time"] in render_markdown(check(m)[0], m)
    assert mfu_words(held.summary("perf")["mfu"], "cpu_time") in summarize(held).replace("\n    ", " ")
    assert keys.PERF_MFU in held.keys_logged()
