"""Every private or undocumented library attribute that ``hf_perf_callbacks.adapter`` touches, named: a library
version that renames one fails here with a message saying which, instead of somewhere deep in a run."""
import inspect
import json
import os

import pytest
import torch
import transformers
import trl
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments
from transformers.trainer_callback import CallbackHandler, ProgressCallback

from hf_perf_callbacks import adapter, default_callbacks, train_with_tuning
from hf_perf_callbacks.tiny import build_model
from tests.conftest import make_trainer


def assert_present(condition: bool, what: str) -> None:
    if not condition:
        pytest.fail(f"{what} is gone (transformers {transformers.__version__}, trl {trl.__version__}, torch "
                    f"{torch.__version__}): update hf_perf_callbacks/adapter.py")


def test_trainer_internals_exist(tokenizer, tmp_path):
    trainer = Trainer(model=build_model(tokenizer), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    assert_present(hasattr(trainer, "_train_batch_size"), "Trainer._train_batch_size")
    assert_present(callable(getattr(trainer, "_save_checkpoint", None)), "Trainer._save_checkpoint")
    assert_present(list(inspect.signature(Trainer._save_checkpoint).parameters)[:3] == ["self", "model", "trial"],
         "Trainer._save_checkpoint(model, trial)")
    assert_present("self.args.save_only_model" in inspect.getsource(Trainer._save_checkpoint),
                   "Trainer._save_checkpoint reading args.save_only_model (adapter.save_checkpoint sets it aside)")
    assert_present(isinstance(trainer.callback_handler, CallbackHandler), "Trainer.callback_handler")
    assert_present("self" in inspect.signature(CallbackHandler.call_event).parameters,
                   "CallbackHandler.call_event's self")
    assert_present(hasattr(trainer, "model_wrapped"), "Trainer.model_wrapped")
    assert_present(list(inspect.signature(Trainer.training_step).parameters)[:3] == ["self", "model", "inputs"],
         "Trainer.training_step(model, inputs, ...)")


def test_the_step_log_and_loss_internals_exist(tokenizer, tmp_path):
    """What ``adapter.StepLog``, ``adapter.loss_shifts_labels`` and ``adapter.calling_trainer`` read: the training
    loop's gradient norm and learning rate getters, its logging step and loss accumulator, and whether the model's
    loss shifts its labels."""
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    assert_present(trainer._loss_shifts_labels is True, "Trainer._loss_shifts_labels (True for a causal LM)")
    assert_present(adapter.loss_shifts_labels(trainer), "adapter.loss_shifts_labels")
    for name in ("_get_grad_norm", "_get_learning_rate", "_maybe_log_save_evaluate"):
        assert_present(callable(getattr(trainer, name, None)), f"Trainer.{name}")
    assert_present(list(inspect.signature(Trainer._maybe_log_save_evaluate).parameters)[:8] ==
                   ["self", "tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval", "start_time"],
                   "Trainer._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys, start)")
    source = inspect.getsource(Trainer)
    for name in ("self._tr_loss", "self._globalstep_last_logged", "self._get_grad_norm(", "self._get_learning_rate()"):
        assert_present(name in source, f"Trainer.{name.removeprefix('self.')}")
    step_log = adapter.StepLog(trainer)
    trainer.train()
    assert_present(step_log.grad_norm is not None and step_log.grad_norm[0] == 1, "the recorded gradient norm")
    assert_present(step_log.learning_rate is not None and step_log.learning_rate[0] == 1, "the recorded rate")
    step_log.undo()
    assert "_get_grad_norm" not in trainer.__dict__ and "_get_learning_rate" not in trainer.__dict__
    found = []
    trainer.add_callback(type("Finds", (transformers.TrainerCallback,), {
        "on_train_begin": lambda self, *a, **k: found.append(adapter.calling_trainer())})())
    trainer.train()
    assert found == [trainer] and adapter.calling_trainer() is None


def test_progress_bar_attribute():
    assert_present(hasattr(ProgressCallback(), "training_bar"), "ProgressCallback.training_bar")


def test_grpo_internals_exist():
    source = inspect.getsource(trl.GRPOTrainer)
    for name in ("self._step", "self._buffered_inputs", "self._metrics"):
        assert_present(name in source, f"GRPOTrainer.{name.removeprefix('self.')}")


def test_torch_internals_exist():
    compiled = torch.compile(torch.nn.Linear(2, 2))
    assert_present(isinstance(getattr(compiled, "_orig_mod", None), torch.nn.Linear), "OptimizedModule._orig_mod")
    missing = [name for name in adapter.COLLECTIVES if not callable(getattr(torch.distributed, name, None))]
    assert_present(not missing, f"torch.distributed.{missing}")
    assert_present(hasattr(torch.distributed.GroupMember, "WORLD"), "torch.distributed.GroupMember.WORLD")


def test_calling_handler_finds_the_dispatching_handler(tokenizer, tmp_path):
    seen = []

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(adapter.calling_handler())

    trainer = Trainer(model=build_model(tokenizer), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]),
                      callbacks=[Probe()])
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert seen == [trainer.callback_handler]
    assert adapter.calling_handler() is None


class Listener:
    def __init__(self):
        self.events = []

    def generate_started(self):
        self.events.append("start")

    def generate_finished(self, input_ids, output):
        self.events.append(("end", output is not None))


def test_one_generate_wrapper_shared_and_removed_by_the_last_listener():
    class Model:
        def generate(self, input_ids):
            if input_ids is None:
                raise RuntimeError("boom")
            return input_ids

    model = Model()
    first, second = Listener(), Listener()
    stop_first = adapter.watch_generate(model, first)
    wrapper = model.__dict__["generate"]
    stop_second = adapter.watch_generate(model, second)
    assert model.__dict__["generate"] is wrapper                      # one wrapper, two listeners
    assert model.generate(input_ids=[1]) == [1]
    with pytest.raises(RuntimeError):
        model.generate(None)
    assert first.events == second.events == ["start", ("end", True), "start", ("end", False)]
    stop_first()
    assert model.__dict__["generate"] is wrapper
    stop_second()
    assert "generate" not in model.__dict__                           # the class's own method is back


def test_intercepted_collectives_are_restored():
    original = torch.distributed.all_gather
    calls = []
    undo = adapter.intercept_collectives(lambda: calls.append(1), lambda: None)
    assert torch.distributed.all_gather is not original
    undo()
    assert torch.distributed.all_gather is original


def test_replace_method_and_its_undo(tokenizer, tmp_path):
    """``trainer.evaluate`` (instance attribute): what ``train()`` calls at an evaluation step."""
    assert_present("self.evaluate(" in inspect.getsource(Trainer._evaluate), "Trainer._evaluate calling self.evaluate")
    trainer = Trainer(model=build_model(tokenizer), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    undo = adapter.replace_method(trainer, "evaluate", lambda original: lambda *a, **k: {"replaced": original})
    assert trainer.evaluate()["replaced"].__func__ is Trainer.evaluate
    undo()
    assert "evaluate" not in trainer.__dict__


def test_rearm_jit_checkpoint_reinstalls_the_sigterm_handler(tokenizer, tmp_path):
    """``JITCheckpointCallback.jit_manager`` and its ``setup_signal_handler``/``_sigterm_handler``."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(model=build_model(tokenizer), args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                           enable_jit_checkpoint=True))
    try:
        jit = [cb for cb in trainer.callback_handler.callbacks if getattr(cb, "jit_manager", None) is not None]
        assert_present(len(jit) == 1, "JITCheckpointCallback.jit_manager")
        manager = jit[0].jit_manager
        assert_present(callable(getattr(manager, "setup_signal_handler", None)),
                       "CheckpointManager.setup_signal_handler")
        assert_present(callable(getattr(manager, "_sigterm_handler", None)), "CheckpointManager._sigterm_handler")
        assert signal.getsignal(signal.SIGTERM) == manager._sigterm_handler
        assert adapter.rearm_jit_checkpoint(trainer) is False                  # installed: nothing to do
        jit[0].on_train_end(trainer.args, trainer.state, trainer.control)       # what train() ends with
        assert signal.getsignal(signal.SIGTERM) != manager._sigterm_handler
        assert adapter.rearm_jit_checkpoint(trainer) is True
        assert signal.getsignal(signal.SIGTERM) == manager._sigterm_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_register_stateful_callbacks_gives_save_checkpoint_every_entry_it_indexes(tokenizer, tmp_path):
    """``Trainer._save_checkpoint`` indexes ``TrainerState.stateful_callbacks[name]`` for every ``ExportableState``
    callback; a state loaded from a checkpoint written without one has no entry for it."""
    assert_present("self.state.stateful_callbacks[cb_name]" in inspect.getsource(Trainer._save_checkpoint),
                   "Trainer._save_checkpoint indexing TrainerState.stateful_callbacks[cb_name]")
    stopper = EarlyStoppingCallback(early_stopping_patience=3)
    trainer = Trainer(model=build_model(tokenizer), callbacks=[stopper],
                      args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                             save_only_model=True))
    trainer.state.stateful_callbacks = {"TrainerControl": trainer.control.state()}   # as a checkpoint without it
    callbacks = trainer.callback_handler.callbacks + [trainer.control]
    assert adapter.register_stateful_callbacks(trainer.state, callbacks) == ["EarlyStoppingCallback"]
    assert adapter.register_stateful_callbacks(trainer.state, callbacks) == []              # once
    stopper.early_stopping_patience_counter = 2
    adapter.save_checkpoint(trainer)
    with open(os.path.join(tmp_path, "checkpoint-0", "trainer_state.json")) as f:
        saved = json.load(f)["stateful_callbacks"]["EarlyStoppingCallback"]
    assert saved["args"]["early_stopping_patience"] == 3                                    # its state at the save
    assert saved["attributes"]["early_stopping_patience_counter"] == 2


@pytest.mark.parametrize("early_stopping", [False, True], ids=["package", "package+EarlyStopping"])
@pytest.mark.parametrize("resume", ["train", "train_with_tuning"])
def test_a_checkpoint_written_without_the_callbacks_resumes_with_them_and_saves_again(tokenizer, tmp_path, one_thread,
                                                                                     early_stopping, resume):
    """The most common first use: a run died, the callbacks are attached and it is resumed. transformers 5.24 alone
    raises ``KeyError: 'ThroughputMeter'`` at the next save (``'EarlyStoppingCallback'`` likewise)."""
    extra = {"save_strategy": "steps", "save_steps": 2}
    if early_stopping:
        extra.update(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, per_device_eval_batch_size=8)
    small = dict(bs=2, ga=1, extra=extra, with_eval=early_stopping)
    make_trainer(tokenizer, tmp_path, [], max_steps=2, **small).train()
    callbacks = default_callbacks() + ([EarlyStoppingCallback(early_stopping_patience=10)] if early_stopping else [])
    trainer = make_trainer(tokenizer, tmp_path, callbacks, max_steps=4, **small)
    if resume == "train":
        trainer.train(resume_from_checkpoint=True)
    else:
        train_with_tuning(trainer, resume_from_checkpoint=True)
    assert trainer.state.global_step == 4
    with open(os.path.join(tmp_path, "checkpoint-4", "trainer_state.json")) as f:
        saved = json.load(f)["stateful_callbacks"]
    expected = {"ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner"}
    assert expected | ({"EarlyStoppingCallback"} if early_stopping else set()) <= set(saved), sorted(saved)
    assert saved["ThroughputMeter"]["attributes"]["saved"]                                 # the real state
    with open(os.path.join(tmp_path, "perf_log.jsonl")) as f:
        assert [e["step"] for e in map(json.loads, f) if e["type"] == "step"] == [3, 4]


def readme_snippet(heading: str) -> str:
    """The first Python block after ``heading`` in the README."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        text = f.read()
    after = text[text.index(heading):]
    return after[after.index("```python") + len("```python"):after.index("```", after.index("```python") + 3)]


def test_the_readme_reproducer_of_the_upstream_keyerror_still_reproduces_it(tmp_path, monkeypatch):
    """The known issue's snippet (plain transformers) fails as the README says; when it stops failing, transformers
    fixed it: drop the known issue, and ``register_stateful_callbacks`` when the oldest supported version has it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyError, match="EarlyStoppingCallback"):
        exec(compile(readme_snippet("KeyError at the first save after a resume"), "README.md", "exec"), {})
