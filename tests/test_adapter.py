"""Every private or undocumented library attribute that ``hf_perf_callbacks.platform.adapter`` touches, named: a library
version that renames one fails here with a message saying which, instead of somewhere deep in a run."""
import inspect
import json
import logging
import os
import re

import pytest
import torch
import transformers
import trl
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments
from transformers.trainer_callback import CallbackHandler, ProgressCallback

from hf_perf_callbacks import default_callbacks, train_with_tuning
from hf_perf_callbacks.platform import adapter
from hf_perf_callbacks.tiny import build_model
from tests.conftest import make_trainer


def assert_present(condition: bool, what: str) -> None:
    if not condition:
        pytest.fail(f"{what} is gone (transformers {transformers.__version__}, trl {trl.__version__}, torch "
                    f"{torch.__version__}): update hf_perf_callbacks/platform/adapter.py")


def test_trainer_internals_exist(tokenizer, tmp_path):
    trainer = Trainer(model=build_model(tokenizer), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    assert_present(hasattr(trainer, "_train_batch_size"), "Trainer._train_batch_size")
    assert_present(callable(getattr(trainer, "_save_checkpoint", None)), "Trainer._save_checkpoint")
    assert_present(list(inspect.signature(Trainer._save_checkpoint).parameters)[:3] == ["self", "model", "trial"],
         "Trainer._save_checkpoint(model, trial)")
    assert_present("self.args.save_only_model" in inspect.getsource(Trainer._save_checkpoint),
                   "Trainer._save_checkpoint reading args.save_only_model (adapter.save_checkpoint sets it aside)")
    assert_present("self._get_output_dir(" in inspect.getsource(Trainer._save_checkpoint)
                   and "self.args.output_dir" in inspect.getsource(Trainer._get_output_dir),
                   "Trainer._save_checkpoint writing into args.output_dir (adapter.save_checkpoint's run_dir)")
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


def test_trl_generation_entry_internals_exist():
    """What ``adapter.watch_generation_entry`` and ``adapter.rollout_counts`` rely on: TRL's ``GRPOTrainer._generate``
    (its tuple: ``prompt_ids, completion_ids, tool_mask, ...``) and ``_calculate_rewards``, the trainer's
    ``use_vllm``/``vllm_mode``/``vllm_generation``, and ``VLLMGeneration.sync_weights`` and ``generate`` (its tuple:
    ``prompt_ids, completion_ids, logprobs, logprob_token_ids``)."""
    from trl.generation.vllm_generation import VLLMGeneration

    source = inspect.getsource(trl.GRPOTrainer)
    for name in ("_generate", "_calculate_rewards", "_generate_single_turn"):
        assert_present(callable(getattr(trl.GRPOTrainer, name, None)), f"GRPOTrainer.{name}")
    assert_present(re.search(r"return \(?\s*prompt_ids,\s*completion_ids,\s*tool_mask,",
                             inspect.getsource(trl.GRPOTrainer._generate)) is not None,
                   "GRPOTrainer._generate's returned tuple")
    for name in ("self.use_vllm", "self.vllm_mode", "self.vllm_generation.sync_weights()",
                 "self.vllm_generation.generate(", "self._calculate_rewards(", "self._generate(prompts)"):
        assert_present(name in source, f"GRPOTrainer: {name}")
    for name in ("sync_weights", "generate"):
        assert_present(callable(getattr(VLLMGeneration, name, None)), f"VLLMGeneration.{name}")
    assert_present("return prompt_ids, completion_ids, logprobs, logprob_token_ids" in
                   inspect.getsource(VLLMGeneration.generate), "VLLMGeneration.generate's returned tuple")
    assert adapter.rollout_counts(adapter.ROLLOUT, ([[1]], [[5, 6, 7], [8]], None)) == (2, 4, 3)
    assert adapter.rollout_counts(adapter.ROLLOUT, ([[1]], [[5, 6, 7]], [[1, 0, 1]])) == (1, 2, 2)  # tools: model's
    assert adapter.rollout_counts(adapter.ENGINE, ([[1]], [[5, 6], [7]], None, None)) == (2, 3, 2)
    assert adapter.rollout_counts(adapter.SYNC, None) == (0, 0, 0)


def test_the_engine_call_internals_exist():
    """What the engine calls are timed at: in server mode the main process's ``VLLMGeneration.vllm_client.generate``
    (the HTTP request), in colocate mode ``VLLMGeneration.llm.generate``; TRL's server path gathers the prompts and
    broadcasts the completions (``gather_object``, ``broadcast_object_list``: the other ranks wait there)."""
    from trl.generation.vllm_generation import VLLMGeneration

    source = inspect.getsource(VLLMGeneration)
    for name in ("self.vllm_client.generate(", "self.llm.generate(", "gather_object(prompts)",
                 "broadcast_object_list(obj_list"):
        assert_present(name in source, f"VLLMGeneration: {name}")


def test_async_grpo_internals_exist():
    """What ``adapter.is_async_grpo``, ``async_rollout_wait``, ``async_trained_tokens`` and the entry watch rely on in
    TRL 1.16's ``trl.experimental.async_grpo``: ``AsyncGRPOTrainer._sync_weight`` (handed, bound, to a
    ``StepIntervalCallback`` as its ``fn``), ``rollout_queue``, ``rollout_worker.start``, ``_rollout_dataset.wait_s``
    (reset by ``_log_step_metrics``) and ``_step_trained_tokens``."""
    try:
        from trl.experimental.async_grpo import async_grpo_trainer
    except ImportError:
        pytest.skip("this TRL has no trl.experimental.async_grpo")
    source = inspect.getsource(async_grpo_trainer)
    if "_step_trained_tokens" not in source:        # TRL 1.0's async trainer: the meter counts the forwards' tokens
        pytest.skip("this TRL's AsyncGRPOTrainer predates the figures TRL 1.16 measures")
    for name in ("def _sync_weight(self)", "StepIntervalCallback(self._sync_weight", "self.fn = fn",
                 "self.rollout_queue =", "self._trainer.rollout_worker.start()", "self.wait_s += wait_s",
                 "self._rollout_dataset.wait_s = 0.0", "self._step_trained_tokens += float(global_n_tokens)",
                 "self._step_trained_tokens = 0.0"):
        assert_present(name in source, f"async_grpo_trainer: {name}")
    trainer = type("Async", (), {"_sync_weight": lambda self: None, "rollout_queue": None,
                                 "_rollout_dataset": type("D", (), {"wait_s": 1.5})(), "_step_trained_tokens": 24.0})()
    assert adapter.is_async_grpo(trainer) and adapter.generation_backend(trainer) == adapter.ASYNC_BACKEND
    assert adapter.async_rollout_wait(trainer) == 1.5 and adapter.async_trained_tokens(trainer) == 24.0
    assert adapter.async_rollout_wait(object()) is None and not adapter.is_async_grpo(object())


def test_watched_collectives_are_timed_and_restored():
    original = torch.distributed.broadcast_object_list
    seen = []
    undo = adapter.watch_collectives(lambda name: seen.append(("in", name)), lambda name: seen.append(("out", name)))
    assert torch.distributed.broadcast_object_list is not original
    with pytest.raises(ValueError):                      # no process group here: the collective raises
        torch.distributed.broadcast_object_list([None], src=0)
    undo()
    assert torch.distributed.broadcast_object_list is original
    assert seen == [("in", "broadcast_object_list"), ("out", "broadcast_object_list")]     # finished on an error


def test_generation_entry_wrappers_tell_each_kind_and_come_off():
    class Engine:
        def sync_weights(self):
            return None

        def generate(self, prompts):
            return prompts, [[1, 2]], None, None

    class Trainer:
        use_vllm, vllm_mode = True, "colocate"

        def __init__(self):
            self.vllm_generation = Engine()

        def _generate(self, prompts):
            self.vllm_generation.sync_weights()
            return prompts, self.vllm_generation.generate(prompts)[1], None

        def _calculate_rewards(self, *args):
            raise RuntimeError("boom")

    class Entries:
        def __init__(self):
            self.events = []

        def entry_started(self, kind):
            self.events.append(("start", kind))

        def entry_finished(self, kind, result):
            self.events.append(("end", kind, result is not None))

    trainer, listener, second = Trainer(), Entries(), Entries()
    assert adapter.generation_backend(trainer) == "vllm-colocate"
    undo = adapter.watch_generation_entry(trainer, listener)
    wrapper = trainer.__dict__["_generate"]
    undo_second = adapter.watch_generation_entry(trainer, second)
    assert trainer.__dict__["_generate"] is wrapper                   # one set of wrappers, two listeners
    trainer._generate([[0]])
    with pytest.raises(RuntimeError):
        trainer._calculate_rewards()
    assert listener.events == second.events == [
        ("start", "rollout"), ("start", "sync"), ("end", "sync", False), ("start", "engine"), ("end", "engine", True),
        ("end", "rollout", True), ("start", "reward"), ("end", "reward", False)]
    undo()
    trainer._generate([[0]])                                            # the other listener still hears it
    assert len(second.events) == 14 and len(listener.events) == 8
    undo_second()
    assert not {"_generate", "_calculate_rewards"} & trainer.__dict__.keys()
    assert not {"sync_weights", "generate"} & trainer.vllm_generation.__dict__.keys()


def test_the_generation_clock_counts_nested_generation_once():
    """TRL's rollout holds a weight sync and (HF) ``model.generate``: the tuner's clock times the outermost call."""
    now = [0.0]
    clock = adapter.GenerationClock(lambda: now[0])
    clock.entry_started(adapter.ROLLOUT)
    clock.entry_started(adapter.SYNC)
    now[0] += 1.0
    clock.entry_finished(adapter.SYNC, None)
    clock.generate_started()
    now[0] += 2.0
    clock.generate_finished(None, None)
    clock.entry_started(adapter.REWARD)                # not generation
    clock.entry_finished(adapter.REWARD, None)
    now[0] += 0.5
    clock.entry_finished(adapter.ROLLOUT, None)
    assert clock.seconds == 3.5 and clock.depth == 0


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


def test_a_compiled_models_generate_is_watched_once_for_all_listeners():
    """``torch.compile(model)`` (an ``OptimizedModule``) hands ``setattr`` of ``generate`` on to the module it wraps:
    the watch is found there, shared by its listeners, and tells nothing once the last one left."""
    class Model(torch.nn.Module):
        def generate(self, input_ids):
            return input_ids

    compiled = torch.compile(Model())
    first, second = Listener(), Listener()
    stop_first = adapter.watch_generate(compiled, first)
    stop_second = adapter.watch_generate(compiled, second)
    assert compiled.generate(input_ids=[1]) == [1]
    assert first.events == second.events == ["start", ("end", True)]
    stop_first()
    stop_second()
    assert compiled.generate(input_ids=[2]) == [2] and first.events == second.events == ["start", ("end", True)]


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
    adapter.register_stateful_callbacks(trainer.state, callbacks)
    added = trainer.state.stateful_callbacks["EarlyStoppingCallback"]
    assert set(trainer.state.stateful_callbacks) == {"TrainerControl", "EarlyStoppingCallback"}
    adapter.register_stateful_callbacks(trainer.state, callbacks)
    assert trainer.state.stateful_callbacks["EarlyStoppingCallback"] is added               # once
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
    """The first Python block after ``heading`` in docs/known-issues.md."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "known-issues.md"),
              encoding="utf-8") as f:
        text = f.read()
    after = text[text.index(heading):]
    return after[after.index("```python") + len("```python"):after.index("```", after.index("```python") + 3)]


def test_the_readme_reproducer_of_the_upstream_keyerror_still_reproduces_it(tmp_path, monkeypatch):
    """The known issue's snippet (plain transformers) fails as the README says; when it stops failing, transformers
    fixed it: drop the known issue, and ``register_stateful_callbacks`` when the oldest supported version has it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyError, match="EarlyStoppingCallback"):
        exec(compile(readme_snippet("KeyError at the first save after a resume"), "docs/known-issues.md", "exec"), {})


def test_fsdp2_internals_the_in_process_resume_relies_on_are_there():
    """``fsdp2_prepared_again`` sets ``FullyShardedDataParallelPlugin.activation_checkpointing`` aside and shadows
    its ``set_auto_wrap_policy``; ``reset_fsdp_iteration`` calls ``FSDPModule.reset_iter_state`` (torch ≥ 2.13; before
    it, the same steps on ``_get_fsdp_state()``'s ``_state_ctx``, ``_comm_ctx`` and parameter groups) and then clears
    each ``FSDPParam``'s ``_unsharded_param.grad`` and ``unsharded_accumulated_grad``. The two-rank FSDP2 runs
    (``tests/test_fsdp.py``, launch) exercise them; this names them where a rename shows first."""
    import dataclasses
    import inspect

    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_state

    assert "activation_checkpointing" in {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    assert callable(FullyShardedDataParallelPlugin.set_auto_wrap_policy)
    accelerate_source = inspect.getsource(__import__("accelerate.accelerator", fromlist=["_"]))
    assert "fsdp_plugin.set_auto_wrap_policy(model)" in accelerate_source            # what the shadow stops
    assert "if self.state.fsdp_plugin.activation_checkpointing:" in accelerate_source
    assert hasattr(FSDPModule, "reset_iter_state") or hasattr(FSDPModule, "_get_fsdp_state")
    param_source = inspect.getsource(_fsdp_param.FSDPParam)
    assert "self._unsharded_param" in param_source and "self.unsharded_accumulated_grad" in param_source
    state_source = inspect.getsource(_fsdp_state)
    assert "self._state_ctx" in state_source and "all_states" in state_source
    assert "_fsdp_param_groups" in state_source or "_fsdp_param_group" in state_source


def test_the_fsdp2_optimizer_resume_fix_names_what_it_relies_on():
    """``fsdp2_optimizer_state_restored`` wraps ``Trainer._load_optimizer_and_scheduler`` (transformers' only call of
    accelerate's ``load_fsdp_optimizer``) and reads the sharded optimizer state with accelerate's private
    ``fsdp_utils._prepare_sd_options`` and ``constants.OPTIMIZER_NAME``, on accelerate < 1.13 only (where
    ``load_fsdp_optimizer`` loads into a stateless ``optimizer.state_dict()``). The two-rank FSDP2 recovery on the
    oldest tested versions (``tests/test_fsdp.py``, launch) shows the state restored; this names the internals."""
    import inspect

    import accelerate
    from accelerate.utils import constants, fsdp_utils
    from transformers import Trainer

    from hf_perf_callbacks.platform import adapter

    assert "load_fsdp_optimizer(" in inspect.getsource(Trainer._load_optimizer_and_scheduler)
    assert callable(fsdp_utils._prepare_sd_options) and constants.OPTIMIZER_NAME == "optimizer"
    loads = inspect.getsource(fsdp_utils.load_fsdp_optimizer)
    version = tuple(int(p) for p in accelerate.__version__.split(".")[:2])
    assert ("get_optimizer_state_dict" in loads) == (version >= adapter.FSDP2_OPTIMIZER_RESUME_FIXED)


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_own_resume_leaves_the_batch_size_out_of_transformers_resume_check(tmp_path):
    """transformers' ``compare_trainer_and_checkpoint_args`` logs a changed batch size on the logger
    ``adapter.RESUME_CHECK_LOGGER``, a line starting with ``adapter.BATCH_SIZE_LINE``: a user's resume shows it; the
    package's own resume (``adapter.own_resume``) leaves that line out and keeps any other mismatch. (Each call
    differs in its values: transformers logs each message once per process.)"""
    from transformers import TrainerState
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args

    def check(micro: int, saved: int, logging_steps: float = 500) -> None:
        args = TrainingArguments(str(tmp_path), per_device_train_batch_size=micro, logging_steps=logging_steps,
                                 use_cpu=True, report_to=[])
        compare_trainer_and_checkpoint_args(args, TrainerState(train_batch_size=saved, logging_steps=500))

    seen = LogRecords()
    target = logging.getLogger(adapter.RESUME_CHECK_LOGGER)
    target.addHandler(seen)
    try:
        check(13, 7)                                          # a user's own resume
        assert_present(len(seen.messages) == 1 and f"\n\t{adapter.BATCH_SIZE_LINE}13 (from args) != 7 (from "
                       f"trainer_state.json)" in seen.messages[0],
                       f"the batch-size line of {adapter.RESUME_CHECK_LOGGER}.compare_trainer_and_checkpoint_args")
        with adapter.own_resume():
            check(17, 9)                                      # the package's re-size: nothing else differs
            check(19, 9, logging_steps=3)                     # another mismatch stays, without the batch size
        assert len(seen.messages) == 2 and "logging_steps: 3 (from args) != 500" in seen.messages[1]
        assert adapter.BATCH_SIZE_LINE not in seen.messages[1]
        check(23, 11)                                         # the filter is gone with the context
        assert len(seen.messages) == 3 and "23 (from args) != 11" in seen.messages[2]
    finally:
        target.removeHandler(seen)


def test_re_sizes_say_one_line_each_and_repeat_no_warning(tokenizer, tmp_path, caplog, one_thread):
    """Two watchdog re-sizes of a GRPO run under ``train_with_tuning`` (a fake MPS reading whose memory grows with
    the micro-batch): each says in one ``[tuner]`` line what changed and why; transformers' batch-size mismatch does
    not appear at their resumes; the FutureWarnings of the deprecated checkpointing methods that TRL calls around
    every generation show once each, not again after each re-size's checkpoint save and load (which reset Python's
    once-per-location memory)."""
    import warnings

    from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog
    from tests.conftest import make_grpo
    from tests.test_tuner import MemoryByBatch

    watchdog, tuner = MemoryWatchdog(limit_gb=3.0, grace_steps=1), AdaptiveBatchTuner(tune=False)
    trainer = make_grpo(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2, completion=4,
                        extra={"activation_checkpointing": True})     # TRL turns it off and on around generation
    watchdog.device = MemoryByBatch(trainer.args)
    mismatch = LogRecords()
    logging.getLogger(adapter.RESUME_CHECK_LOGGER).addHandler(mismatch)
    try:
        with warnings.catch_warnings(record=True) as shown, caplog.at_level(logging.WARNING, "hf_perf_callbacks"):
            warnings.resetwarnings()                          # Python's defaults, not the suite's ignore filters
            train_with_tuning(trainer)
    finally:
        logging.getLogger(adapter.RESUME_CHECK_LOGGER).removeHandler(mismatch)
    assert trainer.state.global_step == 5 and trainer.args.per_device_train_batch_size == 1
    assert [(d.old.micro_batch, d.new.micro_batch) for d in tuner.executor.record.decisions] == [(4, 2), (2, 1)]
    switches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[tuner] step ")]
    assert len(switches) == 2 and "step 2: 4×2, steps_per_generation=2 → 2×4, steps_per_generation=4" in switches[0]
    assert "step 4: 2×4, steps_per_generation=4 → 1×8, steps_per_generation=8" in switches[1]
    assert all("resuming from checkpoint-" in line for line in switches)      # the decisions said why, once
    assert [d.kind for d in tuner.executor.record.decisions] == ["watchdog", "watchdog"]
    assert not [m for m in mismatch.messages if adapter.BATCH_SIZE_LINE in m]
    deprecations = [str(w.message).split()[0] for w in shown if "gradient_checkpointing" in str(w.message)]
    assert sorted(deprecations) == ["`gradient_checkpointing_disable`", "`gradient_checkpointing_enable`",
                                    "`is_gradient_checkpointing`"]


def test_the_loop_state_internals_exist(tokenizer, tmp_path):
    """What ``adapter.LoopState`` reads and sets: the FLOPs not yet stored, the loss window and its step, the loss
    total, all set by ``_inner_training_loop`` before ``on_train_begin`` (where a resume's carry is installed), and
    TRL GRPO's micro-batch counter, generation buffer and metrics."""
    source = inspect.getsource(Trainer._inner_training_loop)
    begin = source.index("on_train_begin")
    for name in ("self._tr_loss =", "self._total_loss_scalar =", "self._globalstep_last_logged ="):
        assert_present(0 <= source.find(name) < begin, f"Trainer.{name[5:-2]} set before on_train_begin")
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    assert_present(trainer.current_flos == 0, "Trainer.current_flos")
    assert_present("self.current_flos +=" in inspect.getsource(Trainer), "Trainer.current_flos counted per batch")
    grpo = inspect.getsource(trl.GRPOTrainer)
    for name in ("self._step", "self._buffered_inputs", "self._metrics",
                 "self._buffered_inputs[self._step % self.args.steps_per_generation]"):
        assert_present(name in grpo, f"GRPOTrainer.{name.removeprefix('self.')}")


def test_a_buffered_generation_is_re_split_in_its_order_and_images_are_refused():
    rows = torch.arange(8)
    buffer = [{"completion_ids": rows[i:i + 2].unsqueeze(1), "num_items_in_batch": torch.tensor(8.0),
               "old_per_token_logps": None, "tags": [f"r{j}" for j in range(i, i + 2)]} for i in range(0, 8, 2)]
    halves = adapter.resplit_generation(buffer, 2)
    assert [h["completion_ids"].flatten().tolist() for h in halves] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [h["tags"] for h in halves] == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]
    assert all(h["num_items_in_batch"].item() == 8.0 and h["old_per_token_logps"] is None for h in halves)
    with pytest.raises(adapter.CannotReplay, match="do not divide"):
        adapter.resplit_generation(buffer, 3)
    with pytest.raises(adapter.CannotReplay, match="images"):
        adapter.resplit_generation([{**part, "pixel_values": torch.zeros(1, 3)} for part in buffer], 8)


def test_the_metrics_trl_adds_to_on_every_loss_call_exist_and_are_put_back():
    """What ``adapter.metrics_kept`` puts back after the exactness check: TRL SFT's and DPO's ``_metrics`` and
    ``_total_train_tokens``, added to in every ``compute_loss``."""
    for trainer_class in (trl.SFTTrainer, trl.DPOTrainer):
        source = inspect.getsource(trainer_class)
        for name in ("self._metrics[mode]", "self._total_train_tokens +="):
            assert_present(name in source, f"{trainer_class.__name__}.{name.removeprefix('self.')}")

    class Holder:
        pass

    holder = Holder()
    holder._metrics = {"train": {"num_tokens": [5]}, "eval": {}}
    holder._total_train_tokens = 5
    with adapter.metrics_kept(holder):
        holder._metrics["train"]["num_tokens"] = [9]
        holder._metrics["train"]["entropy"] = [1.0]
        holder._total_train_tokens = 9
    assert holder._metrics == {"train": {"num_tokens": [5]}, "eval": {}} and holder._total_train_tokens == 5


def test_the_row_stream_hook_sees_each_steps_fetch_and_an_error_leaves_its_batches(tokenizer, tmp_path):
    """``Trainer.get_batch_samples`` (an instance attribute for the row-stream check) fetches a step's micro-batches
    before ``on_step_begin``; the training loop's ``batch_samples`` local (``Trainer._run_epoch``) is read from an
    error's traceback."""
    from transformers import TrainerCallback

    assert_present(list(inspect.signature(Trainer.get_batch_samples).parameters)[:3] ==
                   ["self", "epoch_iterator", "num_batches"], "Trainer.get_batch_samples(epoch_iterator, num_batches)")
    source = inspect.getsource(Trainer)
    assert_present("batch_samples, num_items_in_batch = self.get_batch_samples(" in source,
                   "the training loop's batch_samples local")
    order: list = []

    class Raise(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            order.append(("begin", state.global_step + 1))
            if state.global_step == 1:
                raise RuntimeError("planted")

    trainer = make_trainer(tokenizer, tmp_path, [Raise()], max_steps=3, bs=2, ga=2)
    undo = adapter.watch_batch_samples(trainer, lambda batches, asked, count: order.append(
        ("fetch", trainer.state.global_step + 1, len(batches), asked)))
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    undo()
    assert_present(order == [("fetch", 1, 2, 2), ("begin", 1), ("fetch", 2, 2, 2), ("begin", 2)],
                   f"get_batch_samples before on_step_begin ({order})")
    fetched = adapter.fetched_step(caught.value)
    assert_present(fetched is not None and len(fetched[0]) == 2, f"batch_samples in {adapter.TRAINING_LOOP_FRAMES}")
    assert_present(fetched[1] is not None and int(fetched[1]) > 0, "the training loop's num_items_in_batch local")
    assert "get_batch_samples" not in trainer.__dict__


def test_a_batch_watcher_can_leave_a_fetched_step_untrained_and_the_loop_ends_there_with_its_save(tokenizer, tmp_path):
    """Two watchers share one ``get_batch_samples`` wrapper; one that returns ``SKIP_STEP`` (having set
    ``control.should_training_stop`` and ``should_save``) leaves the fetched step untrained: the training loop gets
    no micro-batch (``for i, inputs in enumerate(batch_samples)`` runs none), breaks on the control and saves the
    last completed step; the watcher after it is not called. Undoing both removes the wrapper."""
    source = inspect.getsource(Trainer)
    assert_present("for i, inputs in enumerate(batch_samples):" in source, "the loop over the fetched micro-batches")
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=6, bs=2, ga=1)
    seen: list = []

    def stop_before_fourth(batches, asked, count):
        if trainer.state.global_step == 3:
            trainer.control.should_training_stop = trainer.control.should_save = True
            return adapter.SKIP_STEP
        return None

    undo_first = adapter.watch_batch_samples(trainer, stop_before_fourth)
    undo_second = adapter.watch_batch_samples(trainer, lambda batches, asked, count: seen.append(
        trainer.state.global_step))
    trainer.train()
    assert trainer.state.global_step == 3 and seen == [0, 1, 2]
    assert os.path.isdir(tmp_path / "checkpoint-3")
    undo_first()
    assert "get_batch_samples" in trainer.__dict__          # the second watcher still watches
    undo_second()
    assert "get_batch_samples" not in trainer.__dict__

def test_the_phase_clocks_name_what_they_wrap(tokenizer, tmp_path):
    """:func:`adapter.clock_trainer` wraps ``Trainer._save_checkpoint`` (private: what
    ``_maybe_log_save_evaluate`` calls for a save, before ``on_save``) and three public methods, undone to what was
    there before; :func:`adapter.time_callbacks` dispatches ``CallbackHandler.call_event`` (its loop over
    ``handler.callbacks``) once per callback, chaining ``control`` as transformers does."""
    assert_present("self._save_checkpoint(model, trial)" in inspect.getsource(Trainer._maybe_log_save_evaluate),
                   "Trainer._maybe_log_save_evaluate calling self._save_checkpoint(model, trial)")
    assert_present("for callback in self.callbacks:" in inspect.getsource(CallbackHandler.call_event),
                   "CallbackHandler.call_event looping over self.callbacks")
    seen: list = []

    class Marker(transformers.TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            seen.append(("marker", "on_log"))

    trainer = make_trainer(tokenizer, tmp_path, [Marker()], max_steps=2, bs=2, ga=1,
                           extra={"save_strategy": "steps", "save_steps": 2})
    before = trainer.__dict__.get("log")
    undo_trainer = adapter.clock_trainer(trainer, lambda p: seen.append(("enter", p)),
                                         lambda p: seen.append(("leave", p)))
    undo_handler = adapter.time_callbacks(trainer.callback_handler,
                                          lambda cb, e: seen.append(("start", type(cb).__name__, e)),
                                          lambda cb, e: seen.append(("end", type(cb).__name__, e)))
    callbacks = trainer.callback_handler.callbacks
    trainer.train()
    assert trainer.callback_handler.callbacks == callbacks            # the list is the handler's again
    phases = {x[1] for x in seen if x[0] == "enter"}
    assert phases == {"data_wait", "log", "save"}                      # no evaluation in this run
    assert ("start", "Marker", "on_log") in seen and seen.index(("marker", "on_log")) \
        == seen.index(("start", "Marker", "on_log")) + 1
    assert not any(x[0] == "start" and x[2] == "on_train_begin" for x in seen)   # dispatched whole
    undo_trainer()
    undo_handler()
    assert trainer.__dict__.get("log") is before and "call_event" not in trainer.callback_handler.__dict__
    assert "_save_checkpoint" not in trainer.__dict__ and "get_batch_samples" not in trainer.__dict__
