"""Performance analysis: each rule on the situation of a field report, a healthy run, ranking, the Markdown report,
and measurements read from a synthetic and a real (demo) run directory."""
import dataclasses
import json
import math
import os
import re

import pytest

from hf_perf_callbacks import estimate, keys
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.dataloader import FACT_TYPES, DataLoaderFacts, dataloader_facts
from hf_perf_callbacks.core.runlog import HF_PERF_TRAIN, ReportError, read_run
from hf_perf_callbacks.core.splitfile import Decision, SplitFile, Trial, trial_figures
from hf_perf_callbacks.report import (
    RULES,
    Finding,
    Measurements,
    Note,
    check,
    console_summary,
    gain_text,
    measurements_from_run,
    render_markdown,
    write_analysis,
)
from hf_perf_callbacks.report.facts import MemoryHit, NothingFound
from hf_perf_callbacks.report.model import (
    MIN_MACHINE_STEPS,
    MIN_STEADY_STEPS,
    TOO_FEW_STEPS,
    Contention,
    Evaluation,
    FirstSteady,
    Machine,
    ModelFacts,
    Rewards,
)
from hf_perf_callbacks.report.render import nothing_found_facts
from hf_perf_callbacks.report.rules import basis
from hf_perf_callbacks.report.words import FRESH_COSTS, REWARD_WORDS
from tests.conftest import schema_lines

QWEN_3B = {"num_hidden_layers": 36, "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936, "params": 3_090_000_000,
           "trainable_params": 15_000_000, "bytes_per_param": 2}
SECTIONS = ("### Observation", "### Root cause", "### Recommendation", "### Expected gain", "### Confidence")


def analyze(m: Measurements) -> list[Finding]:
    """The ranked findings of ``check``."""
    return check(m)[0]


def healthy(**changes) -> Measurements:
    """A healthy CUDA GRPO run: warmup over at 2 steps, little data wait, generation 30%, MFU 0.45, no memory
    pressure, 5% padding, completions near the limit with little clipping."""
    m = Measurements(
        device_type="cuda", world_size=1, grpo=True, micro_batch=8, grad_accum=4, max_completion_length=128,
        num_generations=8, activation_checkpointing=False, model=ModelFacts.of(QWEN_3B),
        dataloader={"num_workers": 0, "persistent_workers": False, "prefetch_factor": None, "pin_memory": True},
        steps=200, warmup_steps=2, warmup_overhead_sec=0.8, first_step_slowdown=1.4, steady_step_sec=2.0,
        steady_tokens_per_sec=9000.0, mfu=0.45,
        phases={"data_wait": 0.02, "generation": 0.30, "compute": 0.68, "eval": 0.0, "save": 0.0},
        pad_fraction=0.05, forwards_per_microbatch=1.0, decode_bandwidth_util=0.4,
        completion_mean=90.0, completion_max=128.0, completion_p90=120.0, clipped_ratio=0.03,
        mem_high_water_gb=30.0, mem_budget_gb=68.0, driver_gb_max=34.0, allocated_gb_at_driver_max=30.0,
        max_pressure=0, swap_growth_gb=0.0, swapout_steps=0, min_steps_to_wall=None, watchdog_actions=[],
        seq_len=400, warmup_done=True, steady_steps=198,
        rewards=Rewards(logs=40, min=0.2, max=1.4, std_max=0.5, zero_std_min=0.1, funcs={}),
        logged=frozenset({keys.PERF_STEADY_TOKENS_PER_SEC, keys.PERF_TOKENS_PER_SEC, keys.MEM_DEVICE_USED_GB}))
    return dataclasses.replace(m, **changes)


def only(m: Measurements) -> Finding:
    findings = analyze(m)
    assert len(findings) == 1, [f.rule for f in findings]
    return findings[0]


def note(m: Measurements, rule: str) -> Note:
    notes = {n.rule: n for n in check(m)[1]}
    assert rule in notes, list(notes)
    return notes[rule]


@pytest.fixture
def calibrated(monkeypatch):
    """The calibration table as if bench_advice had checked every model within 8% on 3 runs on every device."""
    table = {(rule, device): (3, 0.08) for rule in ("input_bound", "duplicate_forward", "padding_waste")
             for device in ("cpu", "cuda", "mps")}
    monkeypatch.setattr(basis, "CALIBRATION", table)
    return table


def test_healthy_run_has_no_findings_and_says_so():
    m = healthy()
    findings, notes = check(m)
    assert findings == [] and [n.rule for n in notes] == ["warmup"]
    assert "cuda" in render_markdown([], m, notes)         # the no-finding wording: tests/golden/healthy_sft.md


def test_the_run_headers_model_and_dataloader_are_read_into_typed_facts():
    facts = ModelFacts.of(QWEN_3B)
    assert facts.shape is not None and (facts.shape.layers, facts.shape.kv_heads, facts.shape.head_dim) == (36, 2, 128)
    assert facts.bytes_per_param == 2
    assert ModelFacts.of({**QWEN_3B, "bytes_per_param": 4}).bytes_per_param == 4
    assert ModelFacts.of({**QWEN_3B, "bytes_per_param": "two"}).bytes_per_param == 2      # not a size: the default
    assert ModelFacts.of({k: v for k, v in QWEN_3B.items() if k != "num_attention_heads"}).shape is None
    assert ModelFacts.of({**QWEN_3B, "num_hidden_layers": "36"}).shape is None
    assert ModelFacts.of(None) == ModelFacts()
    assert dataloader_facts({"num_workers": 2, "persistent_workers": None, "pin_memory": "yes", "prefetch_factor": True,
                             "drop_last": True}) == {"num_workers": 2, "persistent_workers": None}
    assert dataloader_facts({"num_workers": True}) == {} and dataloader_facts(None) == {}
    assert set(FACT_TYPES) == set(DataLoaderFacts.__annotations__)       # the typed facts are the ones read


def test_missing_optional_data_fires_nothing():
    m = healthy(mfu=None, phases={}, pad_fraction=None, forwards_per_microbatch=None, decode_bandwidth_util=None,
                completion_mean=None, completion_max=None, completion_p90=None, clipped_ratio=None,
                first_step_slowdown=None, warmup_overhead_sec=None, warmup_steps=None, mem_high_water_gb=None,
                mem_budget_gb=None, driver_gb_max=None, allocated_gb_at_driver_max=None, max_pressure=None,
                swap_growth_gb=None, model=ModelFacts(), seq_len=None, micro_batch=None, grad_accum=None)
    assert analyze(m) == []


def test_slow_first_steps_on_a_mac_are_a_note_not_a_finding():
    # field report, a GRPO run on a Mac: first batch 29.6 s, steady 4.0 s: 7.3x, ~25 s overhead over 200 steps
    m = healthy(device_type="mps", first_step_slowdown=7.3, warmup_steps=10, warmup_overhead_sec=25.6,
                steady_step_sec=4.0, steady_tokens_per_sec=254.3, mfu=None, decode_bandwidth_util=None)
    assert analyze(m) == []
    n = note(m, "warmup")
    assert (n.reason, n.facts.warmup_steps, n.facts.slowdown) == ("excluded", 10, 7.3)
    assert n.facts.device_type == "mps" and FRESH_COSTS["mps"] in n.text


def test_warmup_in_a_short_run_says_compare_steady_figures():
    n = note(healthy(first_step_slowdown=7.3, warmup_steps=3, warmup_overhead_sec=25.6, steady_step_sec=4.0,
                     steps=10), "warmup")
    # 25.6 s of warmup against 10 steps of 4.0 s: 39% of the time; 122 steps bring it below 5%
    assert n.facts.share == pytest.approx(25.6 / 65.6) and n.facts.target_share == 0.05
    assert n.facts.steps_for_target == math.ceil(25.6 * 0.95 / (0.05 * 4.0)) == 122


@pytest.mark.parametrize("steps, slowdown, says, never", [
    (0, 3.5, "only the first step was slow (3.5x the steady step)", "warmup took 0"),
    (0, 1.0, "no warmup: the first step ran at the steady speed", "first step took"),
    (2, 0.3, "faster than the steady level (0.30x)", "first step took 0.3x"),
])
def test_warmup_wording_never_contradicts_itself(steps, slowdown, says, never):
    # seen: "warmup: ended after 0 steps … first step 3.5x the steady step" and "first step 0.3x the steady step"
    n = note(healthy(warmup_steps=steps, first_step_slowdown=slowdown, warmup_overhead_sec=0.5), "warmup")
    assert says in n.text.lower() and never not in n.text.lower()


def test_a_warmup_without_its_steps_is_not_finished_and_claims_no_steady_figures():
    # seen: "Warmup not finished (no stable window of steps yet…). … the steady figures exclude the warmup steps."
    n = note(healthy(warmup_steps=None, first_step_slowdown=3.0, warmup_overhead_sec=2.0), "warmup")
    assert n.reason == "not_finished" and n.facts.warmup_steps is None          # worded as not finished alone


def test_input_bound_on_cuda_prints_its_number_only_when_calibrated(calibrated):
    f = only(healthy(grpo=False, phases={"data_wait": 0.83, "compute": 0.17}))
    assert f.expected_gain == pytest.approx(1 / (1 - 0.83)) and f.basis == "calibrated" and f.confidence == "high"
    assert "within 8%" in f.gain_formula and "1/(1 − 0.83) = 5.88x" in f.gain_formula
    calibrated["input_bound", "cuda"] = (2, 0.4)                  # the check missed by 40%: no number
    assert only(healthy(grpo=False, phases={"data_wait": 0.83, "compute": 0.17})).expected_gain is None


def test_input_bound_on_cuda():
    # field report: a CUDA run whose GPU waited for the DataLoader (num_workers 0) 83% of the time
    f = only(healthy(micro_batch=1, grad_accum=1,
                     phases={"data_wait": 0.83, "generation": 0.0, "compute": 0.17, "eval": 0.0, "save": 0.0},
                     grpo=False, dataloader={"num_workers": 0, "persistent_workers": False, "prefetch_factor": None,
                                             "pin_memory": False}))
    assert f.rule == "input_bound" and f.basis == "calibrated" and f.confidence == "medium"   # one H100 check, 21%
    assert f.expected_gain == f.predicted_gain == pytest.approx(1 / (1 - 0.83))
    assert "1/(1 − 0.83) = 5.88x" in f.gain_formula and "cuda" in f.gain_formula
    cpu = only(dataclasses.replace(healthy(grpo=False, phases={"data_wait": 0.83, "compute": 0.17}),
                                   device_type="cpu"))
    assert cpu.expected_gain is None and cpu.basis == "try"          # missed by 38% on the CPU: no number there
    assert f.setting == {"dataloader_num_workers": 4, "dataloader_persistent_workers": True,
                         "dataloader_pin_memory": True}
    for setting in ("`dataloader_num_workers: 4`", "`dataloader_persistent_workers: true`",
                    "`dataloader_pin_memory: true`"):
        assert setting in f.recommendation
    assert "83%" in f.observation and "num_workers=0" in f.observation


def test_input_bound_keeps_settings_already_right_and_raises_workers():
    f = only(healthy(grpo=False, phases={"data_wait": 0.4, "compute": 0.6},
                     dataloader={"num_workers": 4, "persistent_workers": True, "prefetch_factor": 4,
                                 "pin_memory": True}))
    assert f.reason == "workers_behind" and f.facts.dataloader["num_workers"] == 4
    assert "persistent_workers" not in f.recommendation and "pin_memory" not in f.recommendation
    assert f.setting == {"dataloader_num_workers": 8}                 # nothing already in effect
    assert "CPU cores" not in f.recommendation


def test_input_bound_on_mps_warns_about_fork_and_leaves_pin_memory_off():
    f = only(healthy(device_type="mps", mfu=None,
                     phases={"data_wait": 0.25, "generation": 0.3, "compute": 0.45, "eval": 0.0, "save": 0.0}))
    assert f.rule == "input_bound"
    assert f.setting["dataloader_num_workers"] == 2 and f.setting["dataloader_pin_memory"] is False
    assert "fork" in f.recommendation


def test_generation_bound_on_cuda_points_at_vllm_and_says_launch_bound():
    # the H100 measurement: generation ~95% of the step, decode under 1% of the bandwidth
    f = only(healthy(phases={"data_wait": 0.0, "generation": 0.95, "compute": 0.05, "eval": 0.0, "save": 0.0},
                     decode_bandwidth_util=0.008, mfu=0.3))
    assert f.rule == "generation_bound" and f.expected_gain is None and f.basis == "try"
    assert f.setting == {"use_vllm": True, "vllm_mode": "colocate"}
    assert "`cache_implementation: static`" in f.recommendation
    assert f.reason == "launch_bound" and f.facts.decode_bandwidth_util == 0.008 and "0.8%" in f.observation
    assert f.facts.generation == 0.95 and "= 20.0x" in f.gain_formula and f.predicted_gain is None
    # vLLM already on: not advised again
    f = only(healthy(phases={"generation": 0.95, "compute": 0.05}, use_vllm=True))
    assert "use_vllm" not in f.setting and f.setting == {"steps_per_generation": 8}


def test_generation_bound_on_mps_doubles_the_configured_generation_batch():
    f = only(healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, steps_per_generation=8,
                     phases={"data_wait": 0.0, "generation": 0.7, "compute": 0.3, "eval": 0.0, "save": 0.0}))
    assert f.rule == "generation_bound" and f.expected_gain is None
    assert "use_vllm" not in f.recommendation
    # the run's own steps_per_generation (8, not the accumulation 4) is what gets doubled
    assert f.setting == {"steps_per_generation": 16} and "(now 8" in f.recommendation


def test_completion_budget_512_to_128():
    # field report, a 3B + LoRA Wordle GRPO run on a Mac: max_completion_length 512 while completions used ~80 tokens
    m = healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2, grad_accum=1,
                num_generations=2, max_completion_length=512, completion_mean=60.0, completion_max=80.0,
                completion_p90=78.0, clipped_ratio=0.0)
    # no completion reached the limit: time is unchanged, so it is a note (memory headroom), not a finding
    assert analyze(m) == []
    n = note(m, "completion_budget")
    assert "`max_completion_length: 128`" in n.text and n.reason == "no_runaways"        # no time to gain
    assert (n.facts.target.new, n.facts.clipped, n.facts.target.tokens) == (128, 0.0, 78.0)     # 78: the p90
    assert estimate.kv_cache_bytes_per_token(estimate.model_from_config(QWEN_3B), 2) == 2 * 36 * 2 * 128 * 2


def printed_bytes(text: str, after: str) -> int:
    """The value of the first printed byte formula that follows ``after`` (``28 layers × 896 hidden × 2 B …``: each
    number followed by its name), evaluated: the text must say what the estimate computes."""
    import re

    formula = text[text.index(after) + len(after):]
    formula = re.match(r"[\d ×()+A-Za-z_]+B(?: \+ \([\d ×()+A-Za-z_]+\) B lm_head)?", formula).group(0)
    return eval(re.sub(r"[A-Za-z_]+", "", formula).replace("×", "*"))


def test_memory_freed_by_a_cut_is_the_estimate_modules_difference():
    # one memory model: what the analysis says a cut frees is what estimate_grpo_memory (the recipes' table) loses
    m = healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2, grad_accum=1,
                num_generations=2, max_completion_length=512, completion_mean=60.0, completion_max=80.0,
                completion_p90=78.0, clipped_ratio=0.01)
    f = only(m)
    assert f.setting == {"max_completion_length": 128}
    # the KV-cache formula with this model's numbers: 2 × 36 × 2 × 128 × 2 B × (512 − 128) × 2 sequences
    assert "2 × 36 layers × 2 kv_heads × 128 head_dim × 2 B × (512 − 128) tokens × 2 sequences" in f.recommendation
    model = {**estimate.model_from_config(QWEN_3B)}
    common = dict(micro_batch=2, num_generations=2, generation_batch=2, prompt_tokens=200, dtype_bytes=2,
                  lora_params=0, activation_checkpointing=False)
    before = estimate.estimate_grpo_memory(model, max_completion_length=512, **common)
    after = estimate.estimate_grpo_memory(model, max_completion_length=128, **common)
    freed = sum(before[k] - after[k] for k in ("kv_cache", "activations", "logits"))
    assert f"frees ≈ {freed / 1024**3:.2f} GiB" in f.recommendation
    per_token = estimate.activation_bytes_per_token(model, 2, False) + estimate.logits_bytes_per_token(model)
    assert printed_bytes(f.recommendation, "training activations and logits = (") == per_token


def test_the_kv_cache_of_a_cut_counts_the_whole_generation_batch():
    # GRPO generates micro-batch × steps_per_generation completions at once (4 × 4 here, not 4 × 1)
    m = healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=4, grad_accum=1,
                steps_per_generation=4, num_generations=4, max_completion_length=512, completion_mean=60.0,
                completion_max=80.0, completion_p90=78.0, clipped_ratio=0.01)
    assert "(512 − 128) tokens × 16 sequences" in only(m).recommendation


def test_completion_budget_with_rare_runaways_is_a_try():
    f = only(healthy(max_completion_length=512, completion_max=512.0, completion_p90=90.0, clipped_ratio=0.02))
    assert f.rule == "completion_budget" and f.setting == {"max_completion_length": 128}
    assert f.expected_gain is None and f.reason == "runaways" and f.facts.seen.max > f.facts.target.new


def test_most_completions_cut_off_is_a_finding_naming_the_limit_and_the_masking():
    # seen: 60% truncated completions listed under "checked and fine"
    m = healthy(completion_mean=127.0, completion_max=128.0, completion_p90=128.0, clipped_ratio=0.9)
    f = only(m)
    assert f.rule == "completion_budget" and "90%" in f.root_cause and f.expected_gain is None
    assert "`mask_truncated_completions: true`" in f.recommendation      # the other bullet, not the setting
    assert f.setting == {"max_completion_length": 256}           # memory 30 of 68 GB: room for a longer limit
    assert "completion_budget" not in {n.rule for n in check(m)[1]}
    near_the_wall = only(dataclasses.replace(m, mem_high_water_gb=60.0))
    assert near_the_wall.setting == {"mask_truncated_completions": True}


def test_a_raised_completion_limit_is_sized_from_the_lengths_observed():
    """94% of completions cut at 8 tokens, the 6% that ended averaging 7: spread evenly from 6 to 8 and growing at
    that rate, 95% end by 6 + 0.95 × 2 / 0.06 ≈ 38 tokens, so 64, not twice the limit (16 left 94% cut)."""
    m = healthy(max_completion_length=8, completion_mean=8.0, completion_max=8.0, completion_p90=8.0,
                clipped_ratio=0.94, completion_terminated_mean=7.0)
    f = only(m)
    assert f.rule == "completion_budget" and f.setting == {"max_completion_length": 64}
    unseen = only(dataclasses.replace(m, completion_terminated_mean=None))     # nothing ended: a guess, said so
    assert unseen.setting == {"max_completion_length": 128} and "a guess" in unseen.recommendation   # 16 × 8
    wide = only(dataclasses.replace(m, max_completion_length=64, completion_terminated_mean=None))
    assert wide.setting == {"max_completion_length": 256}                                   # TRL's default


def test_memory_pressure_swapping_on_a_mac():
    # field report: a 3B + LoRA Wordle GRPO run on a Mac went from ~40 s to 226 s per iteration while swapping
    f = only(healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2, grad_accum=1,
                     num_generations=2, max_completion_length=512, completion_mean=None, completion_max=None,
                     completion_p90=None, clipped_ratio=None, seq_len=600, swap_growth_gb=6.0, swapout_steps=20,
                     max_pressure=2, mem_high_water_gb=40.0, mem_budget_gb=38.0, driver_gb_max=40.0,
                     allocated_gb_at_driver_max=24.0,
                     watchdog_actions=[{"step": 4, "action": "clear_cache", "message": "cleared"}]))
    assert f.rule == "memory_pressure" and f.confidence == "medium" and f.priority == 0
    assert f.expected_gain is None and "not predicted" in f.gain_formula      # no unmeasured multiplier
    assert f.setting == {"activation_checkpointing": True}                    # the item that frees the most
    assert "`per_device_train_batch_size: 1` with `gradient_accumulation_steps: 2`" in f.recommendation
    assert "2 × 1 = 1 × 2 = 2" in f.recommendation
    assert "MPSCacheClearer" in f.recommendation          # the run logged no cache clears: the clearer was missing
    assert "MemoryWatchdog" not in f.recommendation         # it was attached: it measured all this
    # the activation formulas shown are estimate.activation_bytes_per_token's, with this model's numbers
    model = estimate.model_from_config(QWEN_3B)
    assert printed_bytes(f.recommendation, "activations per token ") == estimate.activation_bytes_per_token(
        model, 2, False)
    assert printed_bytes(f.recommendation, "→ ") == estimate.activation_bytes_per_token(model, 2, True)
    per_token = estimate.activation_bytes_per_token(model, 2, False) + estimate.logits_bytes_per_token(model)
    assert f"frees ≈ {per_token * 600 / 1024**3:.2f} GiB" in f.recommendation      # one sequence of 600 tokens less
    assert f.observation.startswith("Swap grew by 6.00 GiB") and "clear_cache at step 4" in f.observation
    assert "16.00 GiB cached" in f.observation


def test_swapping_mac_run_ranks_memory_first_and_cuts_completions_to_128():
    # the whole field report: swapping, 512-token limit, ~80-token completions; 512 → 128 fixed it
    m = healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2, grad_accum=1,
                num_generations=2, max_completion_length=512, completion_mean=60.0, completion_max=80.0,
                completion_p90=78.0, clipped_ratio=0.0, seq_len=600, swap_growth_gb=6.0, swapout_steps=20,
                max_pressure=2)
    findings = analyze(m)
    assert [f.rule for f in findings] == ["memory_pressure"]
    assert "`max_completion_length: 128`" in findings[0].recommendation
    assert "`max_completion_length: 128`" in note(m, "completion_budget").text


def test_memory_pressure_without_swapping_has_no_speed_gain():
    f = only(healthy(max_pressure=1, min_steps_to_wall=8.0))
    assert f.rule == "memory_pressure" and f.expected_gain is None and f.facts.swapping is False
    assert (f.reason, f.facts.steps_to_wall, f.facts.allocator_advice) == ("near_the_wall", 8.0,
                                                                         "expandable_segments")
    assert "expandable_segments" in f.recommendation and f.priority == 0


def test_cuda_reserved_above_allocated_far_from_the_budget_is_no_alarm():
    assert analyze(healthy(driver_gb_max=20.0, allocated_gb_at_driver_max=5.0)) == []


def test_small_micro_batch_is_a_try_with_a_complete_split():
    # seen: "1.40–1.48x" predicted for 2×4 → 8×1 on a CPU, 0.99x measured: no number without a measurement
    f = only(healthy(micro_batch=1, grad_accum=32, mfu=0.05,
                     phases={"data_wait": 0.0, "generation": 0.49, "compute": 0.51, "eval": 0.0, "save": 0.0}))
    assert f.rule == "small_micro_batch" and f.expected_gain is None and f.basis == "try"
    assert f.setting == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}
    assert "AdaptiveBatchTuner()" in f.recommendation and "train_with_tuning" in f.recommendation
    assert "16×2" in f.recommendation and "H100" not in f.gain_formula


def test_small_micro_batch_keeps_an_explicit_generation_batch():
    # steps_per_generation 8 with 1×4: generation batch 8; at 4×1 TRL's default (1) would shrink it to 4
    f = only(healthy(micro_batch=1, grad_accum=4, num_generations=4, steps_per_generation=8, mfu=0.05))
    assert f.setting == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                         "steps_per_generation": 2}


def test_small_micro_batch_with_the_tuner_attached_asks_for_train_with_tuning():
    # seen: "Attach AdaptiveBatchTuner()" on a run that had it attached with tuning off
    f = only(healthy(micro_batch=2, grad_accum=4, mfu=0.05, tuner_attached=True))
    assert "attach" not in f.recommendation.lower() and "`train_with_tuning(trainer)`" in f.recommendation
    assert "`AdaptiveBatchTuner(tune=True)`" in f.recommendation


def test_a_launcher_run_is_told_recipe_keys_not_python_calls():
    # seen: a run of `hf-perf train` told to call train_with_tuning
    f = only(healthy(micro_batch=2, grad_accum=4, mfu=0.05, tuner_attached=True, launcher="hf-perf train"))
    assert "train_with_tuning" not in f.recommendation and "default_callbacks" not in f.recommendation
    assert "recipe's `callbacks`" in f.recommendation and "`tune: true`" in f.recommendation
    assert f.setting == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}    # recipe keys
    mac = only(healthy(device_type="mps", mfu=None, max_pressure=2, launcher="hf-perf train"))
    assert "recipe's `callbacks`" in mac.recommendation and "default_callbacks" not in mac.recommendation
    launched = healthy(launcher="hf-perf train")
    run_line = next(line for line in render_markdown([f], launched).splitlines() if line.startswith("**Run:**"))
    assert f"`{launched.launcher}`" in run_line


def tune_decision(old=(2, 4), new=(2, 4), trials=(), **fields) -> Decision:
    return Decision(kind="tune", step=4, reason="", old=Split(*old), new=Split(*new), trials=list(trials), **fields)


def test_small_micro_batch_after_the_tuner_measured_is_a_note_with_its_trials():
    # seen: "By hand: 4×2" for the split the tuner had just measured slower; its measurement decides instead
    trials = [Trial(Split(2, 4), samples=[1.18, 1.2, 1.17], steps=[1, 2, 3]),
              Trial(Split(4, 2), samples=[1.24, 1.25, 1.23], steps=[4, 5, 6], p_value=0.04, gain=-0.05),
              Trial(Split(8, 1), fits=False, error="out of memory")]
    m = healthy(micro_batch=2, grad_accum=4, mfu=0.05, tuner_attached=True, train_sec=400.0,
                tune=tune_decision(trials=trials, cost_sec=2.0, expected_gain_sec=3.0))
    assert analyze(m) == []
    n = note(m, "small_micro_batch")
    assert n.judged and n.reason == "tuner_measured"
    d = n.facts.decision
    assert (d.old, d.new, n.facts.measured, d.cost_sec) == (Split(2, 4), Split(2, 4), 2, 2.0)
    assert (n.facts.hit.kind, n.facts.hit.micro_batch) == ("trial", 8)     # 8×1 did not fit: no larger one
    # the trials as the note prints them (trial_figures): 4×2 5% slower than 2×4 over all samples, p = 1
    figures = {t.label: t for t in trial_figures(m.tune)}
    assert (figures["4×2"].status, figures["4×2"].steps, figures["4×2"].reference) == ("measured", (4, 5, 6), "2×4")
    assert figures["4×2"].change == pytest.approx(1.24 / 1.18 - 1) and figures["4×2"].p_value == pytest.approx(1.0)
    assert not figures["8×1"].measured and figures["8×1"].error == m.tune.trials[2].error   # 8×1 did not fit
    assert all(t.words() in n.text for t in figures.values())
    assert "failed" not in n.text and "+5%" not in n.text and "-5%" not in n.text


def test_a_tuning_that_cost_more_than_it_saved_is_a_finding_with_its_cost():
    # seen: "Checked and fine: Batch split chosen by measurement" on a quick start whose tuning cost 7.2 s (11% of its
    # training) for an expected saving of 0 s
    trials = [Trial(Split(4, 2), samples=[1.66, 0.24, 4.09, 1.5], steps=[4, 5, 6, 7]),
              Trial(Split(8, 1), samples=[0.7, 0.69, 0.71, 0.65], steps=[10, 11, 12, 13])]
    m = healthy(micro_batch=4, grad_accum=2, mfu=0.05, tuner_attached=True, train_sec=65.0,
                tune=tune_decision(old=(4, 2), new=(4, 2), trials=trials, cost_sec=7.2, expected_gain_sec=0.0))
    findings, notes = check(m)
    f = {f.rule: f for f in findings}["tuning_cost"]
    assert f.basis == "measured" and f.expected_gain == pytest.approx(65.0 / (65.0 - 7.2))
    assert "cost 7.2 s (11% of the 65.0 s of training)" in f.observation
    assert f.facts.decision.new == f.facts.decision.old
    assert "tune=False" in f.recommendation and f.setting == {}
    assert "small_micro_batch" not in [n.rule for n in notes if n.judged]          # no "fine" beside it
    launched = only_rule(healthy(micro_batch=4, grad_accum=2, mfu=0.05, tuner_attached=True, train_sec=65.0,
                                 launcher="hf-perf train", tune=m.tune), "tuning_cost")
    assert launched.setting == {"tune": False} and "`tune: false`" in launched.recommendation


def only_rule(m: Measurements, rule: str) -> Finding:
    return {f.rule: f for f in analyze(m)}[rule]


def test_a_tuning_that_measured_nothing_is_not_judged_never_fine():
    # seen: "Checked and fine: Batch split chosen by measurement" where "4×1 not measured … too short to pay back"
    trials = [Trial(Split(4, 1))]
    m = healthy(micro_batch=4, grad_accum=1, tuner_attached=True, train_sec=100.0,
                tune=Decision(kind="tune", step=0, reason="kept the configured split: too short to pay back",
                              old=Split(4, 1), new=Split(4, 1), trials=trials, cost_sec=0.0))
    n = note(m, "small_micro_batch")
    assert not n.judged and m.tune.reason.split(": ")[-1] in n.text            # the tuner's own reason
    assert "small_micro_batch" not in [n.rule for n in check(m)[1] if n.judged]   # never under "checked and fine"


def test_the_tuner_on_a_plain_train_is_named_in_the_report():
    # seen: AdaptiveBatchTuner() passed to a plain trainer.train() did nothing and said nothing
    from hf_perf_callbacks.core.wording import TUNER_NEEDS_TRAIN_WITH_TUNING

    m = healthy(tuner_attached=True, tuner_hint=TUNER_NEEDS_TRAIN_WITH_TUNING)
    n = note(m, "tuner_hint")
    assert not n.judged and TUNER_NEEDS_TRAIN_WITH_TUNING in n.text and "train_with_tuning(trainer)" in n.text
    assert "tuner_hint" not in [n.rule for n in check(healthy(tuner_attached=True))[1]]


def test_no_micro_batch_larger_than_one_that_ran_out_of_memory_is_advised():
    # seen: `per_device_train_batch_size: 8` advised right after the run ran out of memory at 4
    oom = Decision(kind="oom", step=7, reason="CUDA out of memory", old=Split(4, 2), new=Split(2, 4))
    f = only(healthy(micro_batch=1, grad_accum=16, mfu=0.05, memory_limits=[oom]))
    assert f.setting == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8}   # not 4×4
    limit = MemoryHit(4, "oom", 7, "CUDA out of memory")     # the cap: one below, 3
    assert f.facts.hit == limit
    capped = healthy(micro_batch=2, grad_accum=4, mfu=0.05, memory_limits=[oom])     # 4×2, 8×1: both ≥ 4
    assert analyze(capped) == []
    n = note(capped, "small_micro_batch")
    assert n.reason == "memory_cap" and n.facts.hit == limit
    watchdog = healthy(micro_batch=2, grad_accum=4, mfu=0.05,
                       watchdog_actions=[{"step": 3, "action": "stop", "message": "near the wall"}])
    assert "small_micro_batch" not in [f.rule for f in analyze(watchdog)]


def test_small_micro_batch_splits_keep_grpo_prompt_groups_whole():
    # batching.exact_splits: 2 × 6 with num_generations 4 keeps the generation batch 12 (3 prompt groups) at every
    # larger exact split; with 2 devices the effective batch counts both
    f = only(healthy(micro_batch=2, grad_accum=6, num_generations=4, mfu=0.05))
    assert "(3×4, 4×3, 6×2, 12×1)" in f.recommendation
    f = only(healthy(micro_batch=1, grad_accum=8, world_size=2, num_generations=4, mfu=0.05))
    assert f.facts.micro_batch * f.facts.grad_accum * f.facts.world_size == 16 and "(2×4, 4×2, 8×1)" in \
        f.recommendation
    assert "× 2 devices" in f.observation


def test_small_micro_batch_is_not_recommended_under_memory_pressure():
    findings = analyze(healthy(micro_batch=1, grad_accum=32, mfu=0.05, max_pressure=1))
    assert [f.rule for f in findings] == ["memory_pressure"]


def test_duplicate_forward():
    # field report: a custom compute_loss ran the model a second time with gradients on
    f = only(healthy(forwards_per_microbatch=2.0))
    assert f.rule == "duplicate_forward" and f.setting == {}        # a code fix, not a config key
    assert f.predicted_gain == pytest.approx(1 / (0.32 + 0.68 / 2))
    assert "1/((1 − 0.68) + 0.68/2.00)" in f.gain_formula and "torch.no_grad()" in f.recommendation


def test_padding_waste():
    # field report: a Trainer run padding every batch to a fixed max_length, 45% pad positions
    f = only(healthy(grpo=False, pad_fraction=0.45,
                     phases={"data_wait": 0.0, "generation": 0.0, "compute": 1.0, "eval": 0.0, "save": 0.0}))
    assert f.rule == "padding_waste" and f.expected_gain is None
    assert f.setting == {"train_sampling_strategy": "group_by_length"} and "packing" in f.recommendation


def test_padding_from_pad_to_multiple_of_off_mps_names_that_setting(calibrated):
    # seen: the padding finding blamed left-padded prompts where each batch held one prompt; the padding came from
    # the recipe's MPS-only pad_to_multiple_of: 32 (pad_to_multiple_of none measured 1.21x)
    m = healthy(device_type="cpu", mfu=None, micro_batch=2, grad_accum=4, num_generations=4, pad_to_multiple_of=32,
                pad_fraction=0.45, seq_len=96, seq_len_mean=80.0, phases={"generation": 0.6, "compute": 0.4})
    f = next(f for f in analyze(m) if f.rule == "padding_waste")
    assert f.setting == {"pad_to_multiple_of": None} and "`pad_to_multiple_of: 32`" in f.root_cause
    assert "left-pad" not in f.root_cause
    r = 2 * 31 / 2 / 80
    assert f.predicted_gain == pytest.approx(1 / (0.6 + 0.4 * (1 - r))) and f.basis == "calibrated"


def test_a_gain_calibrated_on_one_device_is_not_printed_for_another():
    # the pad_to_multiple_of model was checked on a CPU (process CPU time) only: a CUDA run gets "try"
    m = healthy(device_type="cuda", mfu=None, micro_batch=2, grad_accum=4, num_generations=4, pad_to_multiple_of=32,
                pad_fraction=0.45, seq_len=96, seq_len_mean=80.0, phases={"generation": 0.6, "compute": 0.4})
    f = next(f for f in analyze(m) if f.rule == "padding_waste")
    assert f.expected_gain is None and f.basis == "try" and f.predicted_gain > 1
    assert "cpu" in f.gain_formula and "cuda" in f.gain_formula              # where it was checked, where not
    assert next(f for f in analyze(dataclasses.replace(m, device_type="cpu"))
                if f.rule == "padding_waste").basis == "calibrated"


def test_grpo_padding_without_a_setting_is_a_note():
    m = healthy(micro_batch=2, num_generations=4, pad_fraction=0.3)
    assert "padding_waste" not in [f.rule for f in analyze(m)]
    n = note(m, "padding_waste")                  # 2 sequences of a group of 4: one prompt per micro-batch
    assert (n.reason, n.facts.prompts_per_micro_batch) == ("grpo_inherent", 1)


def test_ranking_and_markdown_sections(calibrated):
    m = healthy(grpo=False, phases={"data_wait": 0.5, "generation": 0.0, "compute": 0.5, "eval": 0.0, "save": 0.0},
                forwards_per_microbatch=3.0, pad_fraction=0.3, first_step_slowdown=3.0)
    findings, notes = check(m)
    # numbered (calibrated) findings by gain, then "try" ones; warmup is a note
    assert [f.rule for f in findings] == ["input_bound", "duplicate_forward", "padding_waste"]
    assert findings[0].expected_gain > findings[1].expected_gain and findings[2].expected_gain is None
    text = render_markdown(findings, m, notes)
    assert "**Run:** cuda × 1" in text
    for section in SECTIONS:
        assert text.count(section) == len(findings)
    assert text.count("### Setting") == 2 and "dataloader_num_workers: 4" in text     # duplicate_forward: code
    assert gain_text(findings[2]) in text and "**Warmup.**" in text
    assert text.index(findings[0].title) < text.index(findings[1].title) < text.index(findings[2].title)
    console = console_summary(findings, top=2, notes=notes)
    assert findings[0].title in console and findings[2].title not in console and "1 more" in console
    assert "`dataloader_num_workers: 4`" in console and notes[0].title.lower() in console.splitlines()[-1]


def test_no_learning_is_a_finding_ranked_first():
    # seen: every reward 0 for 12 steps (frac_reward_zero_std 1, loss and grad norm 0) reported as "Healthy run"
    m = healthy(logs=12, no_signal_run=12, reward_mean=0.0, temperature=0.7,
                phases={"data_wait": 0.5, "compute": 0.5})
    findings = analyze(m)
    assert [f.rule for f in findings][0] == "no_learning" and findings[0].priority == 0
    f = findings[0]
    assert (f.reason, f.facts.no_signal_run, f.facts.logs, f.facts.reward_mean) == (
        "no_group_variance", 12, 12, 0.0)
    assert f.setting == {"num_generations": 16, "temperature": 1.0}
    assert "Healthy" not in render_markdown(findings, m)       # its words: tests/golden/rules.md (no_learning)
    # a generation batch that cannot hold whole groups of the doubled size gets a larger one
    f = analyze(healthy(num_generations=8, micro_batch=2, grad_accum=2, steps_per_generation=4,
                        logs=5, no_signal_run=4))[0]
    assert f.setting["num_generations"] == 16 and f.setting["steps_per_generation"] == 8
    assert analyze(healthy(logs=12, no_signal_run=2)) == []              # two flat logs are no finding


def test_contention_is_its_own_finding_with_the_measured_loss():
    c = Contention(steps=4, step_list=[1, 2, 3, 4], lost_sec=39.9, run_sec=120.0, lost_share=39.9 / 120.0,
                   wall_over_cpu=2.6, steady_wall_over_cpu=1.05, other_cores=1.6, source="meter")
    f = only(healthy(contention=c))
    assert f.rule == "contention" and f.basis == "measured"
    assert f.expected_gain == pytest.approx(1 / (1 - 39.9 / 120)) and "39.9 s" in f.observation
    assert (f.reason, f.facts.lost_sec, f.facts.contention.other_cores, f.facts.contention.steps) == (
        "other_processes", 39.9, 1.6, 4)
    assert f.steps == [(1, 4)] and f.lost_sec == 39.9     # its words: tests/golden/rules.md (contention)
    assert "OMP_NUM_THREADS" in f.recommendation and f.setting == {}    # how many threads: the machine decides


def test_a_slow_stretch_counts_once_beside_the_step_lines_contention():
    """A log without the meter's own contention figure: the step lines' classification already holds the slow
    stretch's steps, so its seconds are not added twice; a stretch elsewhere adds its own."""
    from hf_perf_callbacks.report.figures import SlowStretch

    c = Contention(steps=10, step_list=list(range(20, 30)), lost_sec=30.0, run_sec=120.0, lost_share=0.25,
                   wall_over_cpu=2.0, steady_wall_over_cpu=1.0, source="step lines")
    inside = SlowStretch(20, 29, "4×2", 0.4, 40.0, 24.0, "contention", 2.0, 1.0)
    elsewhere = SlowStretch(60, 69, "4×2", 0.5, 20.0, 10.0, "contention", 2.0, 1.0)
    assert only(healthy(contention=c, slow_stretches=[inside])).lost_sec == pytest.approx(30.0)
    both = only(healthy(contention=c, slow_stretches=[inside, elsewhere]))
    assert both.lost_sec == pytest.approx(40.0) and (60, 69) in both.steps


def test_no_finding_repeats_a_setting_already_in_effect():
    # every setting a finding carries differs from the run's own configuration
    m = healthy(micro_batch=1, grad_accum=8, mfu=0.05, steps_per_generation=8, pad_to_multiple_of=32,
                device_type="cpu", pad_fraction=0.5, seq_len_mean=60.0,
                phases={"data_wait": 0.4, "generation": 0.3, "compute": 0.3},
                dataloader={"num_workers": 2, "persistent_workers": True, "pin_memory": False})
    configured = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "steps_per_generation": 8,
                  "pad_to_multiple_of": 32, "dataloader_num_workers": 2, "dataloader_persistent_workers": True,
                  "dataloader_pin_memory": False}
    findings = analyze(m)
    assert {f.rule for f in findings} >= {"input_bound", "padding_waste", "small_micro_batch"}
    for f in findings:
        assert f.setting and all(configured.get(k, "unset") != v for k, v in f.setting.items()), (f.rule, f.setting)


def test_rules_list_is_complete_and_pure():
    """Every rule carries its card (its row of the README's table) and every card belongs to a rule of RULES."""
    from hf_perf_callbacks.report.model import CARDS

    names = [r.__name__.removeprefix("rule_") for r in RULES]
    assert len(names) == len(set(names)) == 24 and set(names) == set(CARDS)
    assert all(card.finding or card.note for card in CARDS.values())
    m = healthy(phases={"data_wait": 0.5, "compute": 0.5})
    before = dataclasses.replace(m, phases=dict(m.phases))
    check(m)
    assert m == before


def _write_run(tmp_path, steps, state=True):
    """An MPS run's log (no machine here has MPS), its records built by the run log's own writer classes: a renamed
    or unknown header fact raises here, a renamed step key leaves the reader's figures empty."""
    from hf_perf_callbacks.core.runlog import EventLine, RunHeader, StepLine

    header = RunHeader(session="synthetic")
    header.describe("perf", device="Apple M3 Max", device_type="mps", world_size=1, grpo=True,
                    per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=512,
                    num_generations=2, activation_checkpointing=False, model=QWEN_3B,
                    dataloader={"num_workers": 0, "persistent_workers": False, "prefetch_factor": None,
                                "pin_memory": False})
    header.describe("mem", budget_gb=38.0, device_limit_gb=40.0, system_total_gb=48.0)
    def trainer_log(s):              # the trainer's own log of the step, as the bus copies it into the step line
        return {keys.TRAINER_LOG + "completions/mean_length": 60.0 + s,
                keys.TRAINER_LOG + "completions/max_length": 70.0 + s,
                keys.TRAINER_LOG + "completions/clipped_ratio": 0.0} if state else {}

    lines = [header.to_json()]
    lines += [StepLine(step["step"], None, {**{k: v for k, v in step.items() if k not in ("type", "step")},
                                            **trainer_log(step["step"])}).to_json() for step in steps]
    lines.append(EventLine("mem", "action", "cleared", step=5, details={"action": "clear_cache"}).to_json())
    with open(tmp_path / "perf_log.jsonl", "w") as fh:
        fh.write("\n".join(json.dumps(line) for line in lines) + "\n{truncated")


def _steps(n=10):
    out = []
    for s in range(1, n + 1):
        steady = [40.0 + 20 * t for t in range(3, s + 1)]            # the meter's running steady figures
        out.append({"type": "step", "step": s, keys.PERF_STEADY: int(s > 2), keys.PERF_WARMUP_DONE: int(s > 5),
                    **({keys.PERF_STEADY_STEP_TIME: sum(steady) / len(steady),
                        keys.PERF_STEADY_TOKENS_PER_SEC: 1000.0 * len(steady) / sum(steady)} if s > 5 else {}),
                    keys.PERF_WARMUP_STEPS: 2, keys.PERF_STEP_WALL_SEC: 40.0 + 20 * s,
                    keys.PERF_TRAIN_SEC: 40.0 + 20 * s,
                    keys.PERF_PHASE_SEC["data_wait"]: 1.0, keys.PERF_PHASE_SEC["generation"]: 30.0,
                    keys.PERF_PHASE_SEC["compute"]: 9.0,
                    keys.PERF_PHASE_SEC["eval"]: 0.0, keys.PERF_PHASE_SEC["save"]: 0.0, keys.PERF_PAD_FRACTION: 0.1,
                    keys.PERF_FORWARDS_PER_MICROBATCH: 1.0, keys.PERF_SEQ_LEN: 500 + s, keys.PERF_TOKENS: 1000.0,
                    keys.MEM_DEVICE_USED_GB: 30.0 + s, keys.MEM_DRIVER_GB: 30.0 + s, keys.MEM_ALLOCATED_GB: 20.0,
                    keys.MEM_PRESSURE: 2 if s > 6 else 0, keys.MEM_SWAP_USED_GB: 1.0 + 0.5 * s,
                    keys.MEM_SWAPOUTS: 100 if s > 6 else 0, keys.MEM_STEPS_TO_WALL: 50.0 - s})
    return out


def test_steady_means_read_the_meters_final_warmup_not_the_per_line_flag(tmp_path):
    """Warmup decided at step 6 with step 3 the first steady step: lines 3-5 were written with ``perf/steady`` 0
    before the decision. The steady means of padding and sequence length count steps 3-10, not 6-10."""
    steps = _steps()
    for s in steps:
        s[keys.PERF_STEADY] = int(s["step"] >= 6)
        if s["step"] >= 6:
            s[keys.PERF_FIRST_STEADY_STEP] = 3
        s[keys.PERF_PAD_FRACTION] = 0.5 if s["step"] in (3, 4, 5) else 0.1 if s["step"] > 5 else 0.9
    _write_run(tmp_path, steps)
    m = measurements_from_run(str(tmp_path))
    assert m.pad_fraction == pytest.approx((3 * 0.5 + 5 * 0.1) / 8)
    assert m.seq_len_mean == pytest.approx(sum(500 + s for s in range(3, 11)) / 8)


def test_measurements_from_a_synthetic_run(tmp_path):
    _write_run(tmp_path, _steps())
    m = measurements_from_run(str(tmp_path))
    assert m.device_type == "mps" and m.grpo and m.micro_batch == 2 and m.grad_accum == 1
    assert m.max_completion_length == 512 and m.activation_checkpointing is False and m.model == ModelFacts.of(QWEN_3B)
    assert m.steps == 10 and m.seq_len == 510
    assert m.phases["generation"] == pytest.approx(0.75) and m.phases["data_wait"] == pytest.approx(0.025)
    assert m.steady_step_sec == pytest.approx(40 + 20 * 6.5)        # median of the steady steps 3..10
    assert m.pad_fraction == pytest.approx(0.1) and m.forwards_per_microbatch == 1.0
    assert m.completion_max == 80.0 and m.completion_mean == pytest.approx(65.5)
    assert 78.0 < m.completion_p90 < 80.0 and m.clipped_ratio == 0.0
    assert m.swap_growth_gb == pytest.approx(4.5) and m.swapout_steps == 4 and m.max_pressure == 2
    assert m.driver_gb_max == 40.0 and m.allocated_gb_at_driver_max == 20.0
    assert m.mem_high_water_gb == 40.0 and m.mem_budget_gb == 38.0
    assert m.min_steps_to_wall == 40.0
    assert m.watchdog_actions == [{"step": 5, "action": "clear_cache", "message": "cleared"}]
    assert m.mfu is None and m.decode_bandwidth_util is None
    findings, notes = check(m)
    rules = [f.rule for f in findings]
    assert rules[0] == "memory_pressure" and "generation_bound" in rules
    assert "completion_budget" in [n.rule for n in notes]
    path, findings, _ = write_analysis(read_run(tmp_path))
    text = open(path).read()
    assert path == os.path.join(str(tmp_path), "perf_report.md") and findings
    assert "`max_completion_length: 128`" in text and all(section in text for section in SECTIONS)


def test_measurements_without_trainer_state_or_summary(tmp_path):
    _write_run(tmp_path, _steps(4), state=False)
    m = measurements_from_run(str(tmp_path))
    assert m.completion_max is None and m.clipped_ratio is None and m.steps == 4
    assert "completion_budget" not in [f.rule for f in analyze(m)]


def test_missing_perf_log_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="no perf_log.jsonl"):
        measurements_from_run(str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):          # ReportError is a ValueError
        read_run(str(tmp_path / "missing"))
    (tmp_path / "perf_log.jsonl").write_text("")
    with pytest.raises(ReportError, match="holds nothing"):
        measurements_from_run(str(tmp_path))


def test_a_killed_resumed_session_ignores_the_earlier_summary_and_repeated_steps(tmp_path):
    """Session 1 finished (summary); session 2 resumed from step 2, re-ran steps 3-4 and was killed: its figures
    come from the step lines, each step once (its latest line), not from session 1's stale summary."""
    _write_run(tmp_path, _steps(4), state=False)
    session2 = [{"type": "summary", "source": "perf", "steps": 4, "mfu": 0.9, "steady_step_sec": 1.0,
                 "phases": {"compute": 1.0}},
                {"type": "summary", "source": "mem", "high_water_gb": 99.0, "budget_gb": 38.0, "actions": []},
                {"type": "run", "source": "perf", "device_type": "mps", "world_size": 1, "grpo": True,
                 "resumed_from_step": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                 "max_completion_length": 512, "num_generations": 2, "model": QWEN_3B}]
    rerun = _steps(6)[2:]                                        # steps 3..6 again (an OOM rollback to step 2)
    for s in rerun:
        s[keys.PERF_PHASE_SEC["generation"]] = 10.0                   # the re-run lines differ from the first ones
    with open(tmp_path / "perf_log.jsonl", "a") as fh:
        fh.write("\n" + schema_lines(session2 + rerun))
    m = measurements_from_run(str(tmp_path))
    assert m.steps == 6 and m.mfu is None
    assert m.steady_step_sec == pytest.approx(40 + 20 * 4.5)      # steady steps 3..6, once each
    # steps 1-2 from session 1 (30 s generation), 3-6 re-run (10 s): (2 × 30 + 4 × 10) / (6 × 40 − 4 × 20)
    assert m.phases["generation"] == pytest.approx(100 / 160)
    assert m.mem_high_water_gb == 36.0 and m.swapout_steps == 0  # steps 1..6 once: used 31..36, swap-outs after 6




def test_measurements_from_a_real_demo_run(demo_run):
    m = measurements_from_run(demo_run)
    assert m.device_type == "cpu" and m.grpo and m.steps == 6
    assert m.micro_batch == 4 and m.grad_accum == 2 and m.max_completion_length == 24 and m.num_generations == 4
    assert m.model.shape is not None and m.model.shape.layers == 2 and m.dataloader.get("num_workers") == 0
    assert sum(m.phases.values()) == pytest.approx(1.0) and m.phases["generation"] > 0
    assert m.forwards_per_microbatch == pytest.approx(1.0) and 0 <= m.pad_fraction < 1
    assert m.completion_max is not None and m.completion_max <= 24 and m.clipped_ratio is not None
    assert m.mem_high_water_gb > 0 and m.mem_budget_gb > 0 and m.swapout_steps == 0
    rules = [f.rule for f in analyze(m)]
    assert "duplicate_forward" not in rules and "memory_pressure" not in rules and "input_bound" not in rules


def test_write_analysis_on_the_demo_run(demo_run):
    path, findings, _ = write_analysis(read_run(demo_run))
    text = open(path).read()
    m = measurements_from_run(demo_run)
    assert os.path.basename(path) == "perf_report.md" and text == render_markdown(*check(m)[:1], m, check(m)[1])
    assert "**Run:** cpu × 1 · GRPO · 6 steps" in text
    for f in findings:
        assert f.title in text and f.gain_formula in text
    assert console_summary(findings).splitlines()[0] == console_summary([]).splitlines()[0]


def test_the_calibration_table_is_what_the_advice_check_measured():
    # every number the analysis prints comes from a model checked against runs with the advice applied: the table
    # is recomputed from the result files, so it cannot claim more than they hold
    import glob

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    errors: dict[tuple[str, str], list[float]] = {}
    for path in glob.glob(os.path.join(root, "advice_*.json")):
        for run in json.load(open(path))["runs"]:
            device = "cpu" if run["environment"]["device"].endswith("CPU") else "cuda"
            for row in run["results"]:
                if row.get("measured_gain") and row.get("predicted_gain"):
                    errors.setdefault((row["rule"], device), []).append(
                        abs(row["predicted_gain"] / row["measured_gain"] - 1))
    table = {key: (len(e), round(max(e) + 0.005, 2)) for key, e in errors.items() if max(e) <= 0.25}
    assert basis.CALIBRATION == table
    assert ("input_bound", "cpu") in errors and ("input_bound", "cpu") not in table   # checked, missed by > 25%


def test_a_field_of_another_type_is_skipped_with_a_note_never_a_crash(demo_run, tmp_path):
    """A newer or older writer: every field of every record of a real run's log, and of its trainer logs, in turn
    given another type (a string where a number belongs, a list where a mapping does, a mapping where a string
    does). The summary and the analysis never raise; the analysis names each skipped field it reads."""
    from hf_perf_callbacks.core.runlog import HEADER_KINDS, SUMMARY_KINDS, conform, parse_lines
    from hf_perf_callbacks.report import measurements, summarize

    entries = [json.loads(line) for line in open(os.path.join(demo_run, "perf_log.jsonl"))]
    def expected(entry, key):
        """The type the reader expects of ``key`` in ``entry`` (None: any)."""
        if entry["type"] == "run" and key not in ("sources", "extra", "malformed"):
            return HEADER_KINDS.get(key)
        if entry["type"] == "summary":
            return SUMMARY_KINDS.get(entry.get("source"), {}).get(key)
        return "float" if entry["type"] == "step" and key not in ("step", "time") else None
    checked = 0
    for i, entry in enumerate(entries):
        for key in [k for k in entry if k != "type"]:
            for bad in ("x", [1], {"a": 1}):
                mutated = [dict(e) for e in entries]
                mutated[i][key] = bad
                run = parse_lines([json.dumps(e) for e in mutated], str(tmp_path))
                summarize(run)
                m = measurements(run)
                findings, notes = check(m)
                text = render_markdown(findings, m, notes)
                kind = expected(entry, key)
                if kind and not conform(bad, kind)[0]:
                    skipped = [n for n in notes if n.rule == "log_fields" and not n.judged]   # under Not judged
                    assert skipped and f"`{key}`" in skipped[0].text and skipped[0].text in text, (entry, key, bad)
                elif entry["type"] == "step" and key == "step":
                    assert "unreadable" in text
                checked += 1
    assert checked > 500


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def copy_run(name, tmp_path, **header_facts):
    """A recorded real run's log (``tests/data/<name>``: a Trainer, hidden 256, 16 × 1, 12 steps, on this project's
    2-core CPU while other work kept ~1.7 cores busy), optionally with facts a newer writer adds to its header."""
    from hf_perf_callbacks.core.runlog import RunHeader, parse_record

    out = tmp_path / name
    out.mkdir(parents=True)
    lines = open(os.path.join(DATA, name, "perf_log.jsonl")).read().splitlines()
    if header_facts:
        header = parse_record(json.loads(lines[0]))
        assert isinstance(header, RunHeader)
        header.extra.update(header_facts)
        lines[0] = json.dumps(header.to_json())
    (out / "perf_log.jsonl").write_text("\n".join(lines) + "\n")
    return str(out)


def test_thread_oversubscription_over_the_whole_run_gets_the_thread_count(tmp_path):
    # seen: torch's default 2 threads on a 2-core machine shared with other work, steps of identical work 33-172 s,
    # no contention finding (CPU time rises too when a thread's partner is descheduled); 1 thread was 2.4-3.5x faster
    # recorded: 2 threads 4.1-11.6 s/step, CPU time 1.3-3.3 s/step; the same run at 1 thread took 0.9-1.7 s/step
    for facts in ({}, {"torch_threads": 2, "cpu_cores": 2}):
        m = measurements_from_run(copy_run("two_threads_contended", tmp_path / str(len(facts)), **facts))
        f = {f.rule: f for f in analyze(m)}["oversubscription"]
        assert f.env == {"OMP_NUM_THREADS": "1"} and f.setting == {}
        assert "`OMP_NUM_THREADS=1`" in f.recommendation.splitlines()[0]
        assert "torch.set_num_threads(1)" in f.recommendation
        assert (f.reason, f.facts.machine.threads, f.facts.advised_threads) == ("threads_over_free_cores", 2, 1)
        assert f.lower_bound and f.basis == "measured" and f.expected_gain > 1.2
        assumed = f.facts.machine.threads_from != "run header"                 # an assumption is said to be one
        assert assumed == (not facts) and (f.facts.machine.threads_from in f.observation) == assumed
        text = render_markdown([f], m)
        assert "### Environment" in text and "OMP_NUM_THREADS=1" in text and f"≥ {f.expected_gain:.2f}x" in text
        assert "`OMP_NUM_THREADS=1` (environment)" in console_summary([f])
        assert note(m, "warmup").facts.contention_findings == ("oversubscription",)   # not booked as warmup
    launched = measurements_from_run(copy_run("two_threads_contended", tmp_path / "l", launcher=HF_PERF_TRAIN))
    assert launched.launcher == HF_PERF_TRAIN
    f = {f.rule: f for f in analyze(launched)}["oversubscription"]
    assert f"`OMP_NUM_THREADS=1 {HF_PERF_TRAIN} --config …`" in f.recommendation
    assert "set_num_threads" not in f.recommendation
    one = measurements_from_run(copy_run("one_thread_contended", tmp_path))
    assert "oversubscription" not in [f.rule for f in analyze(one)]    # already at one thread: nothing to advise
    ran_at_one = measurements_from_run(copy_run("one_thread_contended", tmp_path / "h", torch_threads=1, cpu_cores=2))
    assert "oversubscription" not in [f.rule for f in analyze(ran_at_one)]


def test_oversubscription_needs_its_evidence():
    machine = Machine(steps=12, busy=0.3, other=1.7, load=4.9, cores=2, cores_from="run header", threads=2,
                      threads_from="run header", spread=1.9, cpu_spread=1.6, lower_bound=1.4)
    assert only(healthy(device_type="cpu", mfu=None, machine=machine)).rule == "oversubscription"
    for change in ({"steps": MIN_MACHINE_STEPS - 1}, {"other": 0.2}, {"busy": 1.8}, {"spread": 1.1, "cpu_spread": 1.1},
                   {"threads": 1}, {"threads_from": "assumed", "cpu_spread": 1.2}):
        changed = dataclasses.replace(machine, **change)
        assert analyze(healthy(device_type="cpu", mfu=None, machine=changed)) == [], change
    launcher = only(healthy(device_type="cpu", mfu=None, machine=machine, launcher=HF_PERF_TRAIN))
    assert launcher.facts.launcher and launcher.env == {"OMP_NUM_THREADS": "1"}   # the words: golden/rules.md
    assert "set_num_threads" not in launcher.recommendation and HF_PERF_TRAIN in launcher.recommendation


def test_a_run_too_short_for_its_timings_says_so_and_prints_no_gain(calibrated):
    # seen: "1.05x (calibrated, medium confidence)" from 2 steps with warmup unfinished
    m = healthy(device_type="cpu", mfu=None, micro_batch=2, grad_accum=4, num_generations=4, pad_to_multiple_of=32,
                pad_fraction=0.45, seq_len=96, seq_len_mean=80.0, phases={"generation": 0.6, "compute": 0.4},
                steps=2, warmup_done=False, steady_steps=0, warmup_steps=None, forwards_per_microbatch=2.0)
    findings, notes = check(m)
    assert {f.rule for f in findings} == {"padding_waste", "duplicate_forward"}     # counts, not timings
    for f in findings:
        assert f.expected_gain is None and f.basis == TOO_FEW_STEPS and "too few steps to judge" in gain_text(f)
        assert "warmup was not finished after 2 steps" in f.gain_formula
    assert [f.rule for f in findings] == ["duplicate_forward", "padding_waste"]     # the order of RULES, every time
    unjudged = {n.rule: n for n in notes if not n.judged}
    assert set(unjudged) >= {"evidence", "warmup"} and "not finished after 2 steps" in unjudged["warmup"].text
    assert "No warmup" not in unjudged["warmup"].text
    assert "Data wait, generation share" not in unjudged["evidence"].text
    assert "generation share" in unjudged["evidence"].text
    # timing rules wait: a generation-bound or input-bound run two steps long is not judged either
    assert analyze(dataclasses.replace(m, pad_fraction=0.0, forwards_per_microbatch=1.0,
                                       phases={"data_wait": 0.5, "generation": 0.4, "compute": 0.1})) == []
    text = render_markdown(findings, m, notes)
    assert "## Not judged" in text and "**too few steps** —" in text
    console = console_summary(findings, notes=notes)
    assert "not judged: warmup not finished; too few steps to judge (warmup was not finished after 2 steps)" in console
    # three steady steps are enough
    enough = dataclasses.replace(m, warmup_done=True, warmup_steps=2, steady_steps=MIN_STEADY_STEPS, steps=5)
    assert {f.rule: f.basis for f in analyze(enough) if f.rule != "generation_bound"} == {
        "duplicate_forward": "calibrated", "padding_waste": "calibrated"}


def test_the_no_finding_text_fits_the_run():
    # seen: "the run's rewards vary" and "Track `perf/steady_tokens_per_sec`" on a Trainer run that never logged it
    trainer = healthy(grpo=False, logged=frozenset({keys.PERF_TOKENS_PER_SEC}), rewards=None)
    facts = nothing_found_facts(trainer, check(trainer)[1])
    assert (facts.rewards, facts.metric) == (None, keys.PERF_TOKENS_PER_SEC)
    text = render_markdown([], trainer, check(trainer)[1])
    assert "reward" not in text.lower() and "`perf/tokens_per_sec`" in text and "steady_tokens" not in text
    grpo = healthy(rewards=None, logged=frozenset())
    findings, notes = check(grpo)
    assert not findings and nothing_found_facts(grpo, notes) == NothingFound(True, True, "none", False, None)
    text = render_markdown(findings, grpo, notes)
    assert REWARD_WORDS["none"] in text and "Track" not in text      # the words: tests/golden/rules.md


def test_a_constant_reward_gets_no_setting_that_cannot_move_it():
    # seen: a GRPO run whose rewards were all 0 advised `num_generations` and `temperature`
    flat = Rewards(logs=8, min=0.0, max=0.0, std_max=0.0, zero_std_min=1.0,
                   funcs={"format_reward": (0.0, 0.0), "solved_reward": (0.0, 0.0)})
    f = analyze(healthy(rewards=flat, logs=8, no_signal_run=8, temperature=0.7))[0]
    assert f.rule == "no_learning" and f.setting == {} and f.reason == "constant_reward"
    assert f.facts.reward_funcs == (("format_reward", 0.0), ("solved_reward", 0.0))
    assert "`format_reward` 0, `solved_reward` 0" in f.observation
    # seen: `max_completion_length: 64` as the first setting of a reward that is always 0: no length moves it
    cut = analyze(healthy(rewards=flat, logs=8, no_signal_run=8, clipped_ratio=0.9, completion_max=128.0,
                          completion_p90=128.0, completion_mean=128.0))[0]
    assert cut.setting == {} and (cut.facts.clipped, cut.facts.raised.new) == (0.9, 256)
    first, *later = cut.recommendation.splitlines()      # the words: tests/golden/rules.md (constant_reward_cut)
    assert "max_completion_length" not in first and "`max_completion_length: 256`" in later[-1]
    # rewards that differ between prompts but never within a group: more samples per prompt can help
    between = dataclasses.replace(flat, max=0.4)
    f = analyze(healthy(rewards=between, logs=8, no_signal_run=8, temperature=0.7))[0]
    assert f.setting == {"num_generations": 16, "temperature": 1.0}
    two = healthy(rewards=dataclasses.replace(flat, logs=2), logs=2, no_signal_run=2)
    assert analyze(two) == [] and not note(two, "no_learning").judged          # two logs: too few to judge


def test_more_steps_per_generation_states_the_off_policy_cost():
    f = only(healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, grad_accum=4, steps_per_generation=4,
                     phases={"generation": 0.7, "compute": 0.3}))
    assert f.setting == {"steps_per_generation": 8}
    assert "off-policy" in f.recommendation and f.facts.optimizer_steps_per_rollout == 2


def test_the_tuners_record_is_read_through_its_schema(tmp_path):
    """measurements() reads tuner_split.json through splitfile.read_split_file: a tune decision (its trials) and the
    oom / watchdog decisions; a file off the schema is skipped with a note."""
    _write_run(tmp_path, _steps(4), state=False)
    trials = [Trial(Split(2, 1), samples=[1.0, 1.1, 1.05], steps=[1, 2, 3]),
              Trial(Split(1, 2), samples=[1.3, 1.2, 1.25], steps=[4, 5, 6], p_value=0.05, gain=-0.19)]
    from hf_perf_callbacks.core.runlog import read_run

    session = read_run(str(tmp_path)).header().session               # this run's record, not another's
    split_file = SplitFile(session=session, world_size=1, configured=Split(2, 1), split=Split(1, 2), decisions=[
        tune_decision(old=(2, 1), new=(2, 1), trials=trials),
        Decision(kind="oom", step=5, reason="out of memory", old=Split(2, 1), new=Split(1, 2))])
    split_file.write(str(tmp_path))
    m = measurements_from_run(str(tmp_path))
    assert m.tune == split_file.decisions[0] and [d.kind for d in m.memory_limits] == ["oom"]
    n = note(m, "small_micro_batch")              # the record's trials, as every reader prints them
    one = {t.label: t for t in trial_figures(m.tune)}["1×2"]
    assert (one.steps, one.reference, one.reference_steps) == ((4, 5, 6), "2×1", (1, 2, 3)) and one.words() in n.text
    assert one.median == pytest.approx(1.25) and one.change == pytest.approx(1.25 / 1.05 - 1)
    assert {f.rule: f for f in analyze(m)}["memory_pressure"].facts.ooms == ((2, 5, "1×2"),)
    (tmp_path / "tuner_split.json").write_text(json.dumps({"decisions": [{"kind": "probe"}]}))
    m = measurements_from_run(str(tmp_path))
    assert m.tune is None and note(m, "log_fields").facts.skipped == tuple(m.skipped)
    assert any(s.startswith("`tuner_split.json`") for s in m.skipped)


def test_every_key_a_launcher_run_is_told_is_a_recipe_key():
    """A run of `hf-perf train` is told recipe keys: every `key: value` and every setting key of its findings is a
    key the launcher accepts (RecipeArguments, GRPOConfig, ModelConfig): a renamed key breaks this test."""
    import re

    from hf_perf_callbacks.train import field_names

    names = set(field_names())
    launcher = dict(launcher="hf-perf train", tuner_attached=True)
    runs = [healthy(micro_batch=2, grad_accum=4, mfu=0.05, **launcher),
            healthy(device_type="mps", mfu=None, max_pressure=2, micro_batch=2, grad_accum=2, **launcher),
            healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, phases={"generation": 0.7,
                    "compute": 0.3}, **launcher),
            healthy(clipped_ratio=0.9, completion_max=128.0, completion_p90=128.0, **launcher)]   # GRPO: the launcher's
    told = 0
    for m in runs:
        for f in analyze(m):
            text = f.recommendation
            keys_told = set(f.setting) | set(re.findall(r"`([a-z_]+): [^`]+`", text)) | set(
                re.findall(r"recipe's `([a-z_]+)`", text))
            assert keys_told <= names, (f.rule, keys_told - names)
            assert "train_with_tuning" not in text and "default_callbacks" not in text, f.rule
            told += len(keys_told)
    assert told >= 8


# ---------------------------------------------------------------- advice that fits the evidence
def evaluation(evals=40, every=1, eval_sec=60.0, train_sec=40.0, steps=40) -> Evaluation:
    return Evaluation(evals=evals, every=every, eval_sec=eval_sec, wall_sec=eval_sec + train_sec,
                      train_sec=train_sec, steps=steps, share=eval_sec / (eval_sec + train_sec))


def test_evaluation_taking_most_of_the_wall_time_is_a_finding_with_its_measured_gain():
    # seen: a run spending 60% of its wall time in evaluation (eval_steps=1) got "No rule found something to change",
    # its header's s/step leaving evaluation out; eval_steps 20 made it 2.2-2.5x faster
    e = evaluation()
    m = healthy(evaluation=e, phases={"compute": 0.4, "eval": 0.6})
    f = only_rule(m, "evaluation")
    assert f.basis == "measured" and f.setting == {"eval_strategy": "steps", "eval_steps": 50}
    saved = 60.0 / 40 * (40 - 1)       # every 50 steps over 40: the last evaluation at the end still runs
    e, i = f.facts.evaluation, f.facts.interval
    assert i.events_after == 1
    assert f.expected_gain == pytest.approx(100.0 / (100.0 - saved)) and f.expected_gain > 2.2
    assert (e.evals, i.every, e.eval_sec, e.wall_sec) == (40, 1, 60.0, 100.0)
    assert e.share == 0.6 and i.saved_sec == pytest.approx(saved)
    assert "`eval_steps: 50`" in f.recommendation.splitlines()[0]
    text = render_markdown([f], m)                  # the header shows both step times (words: golden/rules.md)
    assert f"{e.wall_sec / m.steps:.3g} s/step" in text and f"{m.steady_step_sec:.3g} s/step" in text
    assert "evaluation" not in [f.rule for f in analyze(healthy(evaluation=evaluation(eval_sec=2.0)))]
    assert "evaluation" not in [f.rule for f in analyze(healthy(evaluation=evaluation(evals=1)))]


def test_the_warmup_note_names_only_a_finding_the_report_has():
    # seen: 7 of 20 reports said "see the oversubscription or contention finding" where none was in the report
    small = Contention(steps=1, step_list=[3], lost_sec=0.5, run_sec=120.0, lost_share=0.5 / 120.0,
                       wall_over_cpu=2.0, steady_wall_over_cpu=1.0, other_cores=1.2, source="meter")
    m = healthy(contention=small, first_step_slowdown=3.0, warmup_steps=2, warmup_overhead_sec=4.0)
    assert "contention" not in [f.rule for f in analyze(m)]
    facts = note(m, "warmup").facts                 # no finding named: the measured seconds
    assert (facts.contention_findings, facts.contention.lost_sec) == ((), 0.5)
    large = dataclasses.replace(small, lost_sec=40.0, lost_share=40.0 / 120.0)
    m = healthy(contention=large, first_step_slowdown=3.0, warmup_steps=2, warmup_overhead_sec=4.0)
    assert "contention" in [f.rule for f in analyze(m)] and note(m, "warmup").facts.contention_findings == \
        ("contention",)


def test_a_first_step_among_the_steady_steps_is_not_said_to_be_excluded():
    # seen: "the steady figures exclude them" where step 1 (21.49 s) was among the steady steps (16.70 s a steady
    # step with it, 16.27 s without)
    first = FirstSteady(step=1, included=True, sec=21.49, with_it=16.70, without_it=16.27)
    n = note(healthy(warmup_steps=0, first_step_slowdown=1.29, warmup_overhead_sec=0.0, first_steady=first),
             "warmup")
    assert "exclude" not in n.text and n.reason == "first_step_steady"
    assert (n.facts.first.step, n.facts.first.sec, n.facts.first.without_it) == (1, 21.49, 16.27)
    excluded = note(healthy(first_steady=FirstSteady(step=1, included=False)), "warmup")
    assert excluded.reason == "excluded" and "exclude" in excluded.text


def test_a_last_step_at_the_steady_wall_cpu_ratio_is_no_contention(tmp_path):
    # seen: a contention finding naming the run's last step as early contention, "wall/CPU 3.95 against 3.95 when
    # steady" (the meter had judged a late train() call against its own first steps)
    from hf_perf_callbacks.report import measurements_from_run
    lines = [{"type": "run", "session": "s", "resumed_from_step": 0, "sources": ["perf"], "device_type": "cpu",
              "world_size": 1, "torch_threads": 1, "cpu_cores": 2}]
    for step in range(1, 13):
        wall = 3.95 if step == 12 else 1.0
        lines.append({"type": "step", "step": step, keys.PERF_STEP_WALL_SEC: wall, keys.PERF_TRAIN_SEC: wall,
                      keys.PERF_CPU_SEC: wall / 1.0 if step == 12 else 1.0, keys.PERF_TOKENS: 100.0,
                      keys.PERF_STEADY: int(step > 2), keys.PERF_OTHER_CPU_CORES: 0.5})
    lines.append({"type": "summary", "source": "perf", "steps": 12, "warmup_done": True, "warmup_steps": 2,
                  "first_steady_step": 3, "early_contention_sec": 3.0, "contention_steps": [12]})
    (tmp_path / "perf_log.jsonl").write_text(schema_lines(lines))
    m = measurements_from_run(str(tmp_path))
    assert m.contention is None and "contention" not in [f.rule for f in analyze(m)]


def test_fixed_length_padding_in_sft_gets_sfttrainers_own_collator_and_no_unfounded_ceiling():
    # seen: `DataCollatorForLanguageModeling(tokenizer, mlm=False)` as the first bullet of an SFT run (it crashes in
    # SFTTrainer); "ceiling 3.65x" beside 1.5x measured (per-step costs that do not shrink)
    base = dict(grpo=False, fixed_seq_len=128, pad_fraction=0.87, seq_len=128, seq_len_min=128, mfu=None,
                phases={"compute": 0.9, "data_wait": 0.05}, rewards=None)
    sft = only_rule(healthy(**base, trainer_kind="sft"), "padding_waste")
    first = sft.recommendation.splitlines()[0]
    assert "SFTTrainer" in first and "DataCollatorForLanguageModeling" not in sft.recommendation
    plain = only_rule(healthy(**base), "padding_waste")
    assert "DataCollatorForLanguageModeling(tokenizer, mlm=False)" in plain.recommendation.splitlines()[0]
    for f in (sft, plain):
        assert "ceiling" not in f.gain_formula and not re.search(r"\d\.\d\dx", f.gain_formula)
        assert f.reason == "fixed_length" and f.predicted_gain is None


def test_the_readme_rule_table_is_the_rules_own():
    """docs/report.md's rule table is generated from the rules' cards (thresholds from the rules' constants), in the
    order of RULES; regenerate it with ``python -m hf_perf_callbacks.report.rules``."""
    from hf_perf_callbacks.report.rules import rule_table

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "report.md"),
                  encoding="utf-8").read()
    start = readme.index("\n", readme.index("<!-- rule table:")) + 1
    block = readme[start:readme.index("<!-- end of rule table -->")].rstrip("\n")
    assert block == rule_table()
    rows = [line.split(" | ")[0].removeprefix("| ").strip("`") for line in block.splitlines()[2:]]
    assert rows == [r.__name__.removeprefix("rule_") for r in RULES]
