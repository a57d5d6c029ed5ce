"""Fault planting for ``tests/test_faults.py`` and ``tests/scripts/fault_run.py``, in the manner of Composer's
auto-microbatching tests: a real error raised at one phase of one optimizer step of a real Trainer.

Phases: ``forward`` and ``backward`` (the training micro-batch), ``generation`` (GRPO's no-grad forwards while it
generates), ``optimizer`` (inside ``optimizer.step``, after one weight was already changed: a half-updated step),
``eval`` (the no-grad forwards of an evaluation, only for micro-batches larger than ``limit``) and
``save:<file>`` (while transformers writes that file of ``checkpoint-<at>``: a partial file is left, then the error).
"""
from __future__ import annotations

import contextlib
import os

import torch
from transformers import TrainerCallback

from hf_perf_callbacks.resize.agreement import ResizeNeeded
from hf_perf_callbacks.throughput import forward_entry

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"

#: the files of a checkpoint a save:<file> phase can cut short
SAVE_FILES = ("model", "optimizer", "scheduler", "rng", "trainer_state")


def weights(model) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``model`` holds (the adapter for a PEFT model), as CPU copies."""
    if hasattr(model, "peft_config"):
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for name in ("adapter_model.safetensors", "model.safetensors"):
        if os.path.exists(os.path.join(path, name)):
            return load_file(os.path.join(path, name))
    raise AssertionError(f"no weights file in {path}: {os.listdir(path)}")


def same(a: dict, b: dict) -> bool:
    keys = set(a) & set(b)
    return bool(keys) and all(torch.equal(a[k], b[k]) for k in keys)


class Fault(TrainerCallback):
    """One planted fault (``times`` firings) at ``phase`` of optimizer step ``at`` (1-based; save phases: while
    writing ``checkpoint-<at>``; eval: every evaluation, micro-batches above ``limit``). ``error``: ``"oom"`` (the
    CUDA text), ``"bare"`` (a ``MemoryError()`` with no message), ``"other"`` (a ``ValueError``), ``"interrupt"``
    (a ``KeyboardInterrupt``: Ctrl-C, or a SIGTERM handler that raises) or ``"agreed"`` (the ``ResizeNeeded`` that
    every rank raises once the ranks agreed on an out-of-memory error). Records the weights at the end of every step
    (``after``) and at the start of every resumed ``train()`` (``resumed``), to compare with what was saved.
    ``micro_batch``: the training forward of step ``at`` that fails (``forward``: 2 is its second micro-batch, after
    the first one was trained and counted). The package's own passes (the exactness check of a re-size) are no
    training forward: the fault is planted in the run's steps only (a size-aware wall: tests/test_exactness.py)."""

    def __init__(self, phase: str, at: int, error: str = "oom", times: int = 1, limit: int = 0, micro_batch: int = 1):
        self.phase, self.at, self.error, self.left, self.limit = phase, at, error, times, limit
        self.micro_batch, self.forwards = micro_batch, 0
        self.fired, self.step, self.model, self.bus = 0, 0, None, None
        self.after: dict[int, dict] = {}
        self.resumed: dict[int, dict] = {}
        self._optimizers: set[int] = set()

    def make_error(self) -> BaseException:
        return {"oom": lambda: torch.OutOfMemoryError(CUDA_OOM), "bare": MemoryError,
                "other": lambda: ValueError("planted failure"), "interrupt": KeyboardInterrupt,
                "agreed": lambda: ResizeNeeded("out of memory on another rank")}[self.error]()

    def due(self) -> bool:
        return self.left > 0 and self.step + 1 == self.at

    def fire(self) -> None:
        self.left -= 1
        self.fired += 1
        raise self.make_error()

    # ------------------------------------------------------------ hooks on the model
    def attach(self, trainer):
        from hf_perf_callbacks.common.bus import bus_for

        self.bus = bus_for(trainer.callback_handler)
        self.model = trainer.model
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if self.phase == "backward":
            inner.model.layers[0].register_full_backward_hook(self._backward)
        else:                 # where every forward enters through __call__ (peft < 0.21 calls the causal LM's forward)
            forward_entry(inner).register_forward_pre_hook(self._forward, with_kwargs=True)
        return trainer

    def _backward(self, module, grad_in, grad_out):
        if self.due() and not self.bus.own_passes:
            self.fire()

    def _forward(self, module, args, kwargs):
        if self.bus.own_passes:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        grad = torch.is_grad_enabled()
        if self.phase == "forward" and grad and self.due():
            self.forwards += 1
            if self.forwards >= self.micro_batch:
                self.fire()
        if self.phase == "generation" and not grad and self.due():
            self.fire()
        if self.phase == "eval" and not grad and ids is not None and ids.shape[0] > self.limit and self.left > 0:
            self.fire()

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        if self.due():
            param = next(p for group in optimizer.param_groups for p in group["params"])
            with torch.no_grad():
                param.add_(1.0)                     # the step is half done when memory runs out
            self.fire()

    # ------------------------------------------------------------ trainer events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.step = state.global_step
        if state.global_step > 0:
            self.resumed[state.global_step] = weights(self.model)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.forwards = 0
        if self.phase == "optimizer" and optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            if id(inner) not in self._optimizers:
                self._optimizers.add(id(inner))
                inner.register_step_pre_hook(self._optimizer_pre_hook)

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        self.after[state.global_step] = weights(self.model)

    # ------------------------------------------------------------ checkpoint files
    def save_due(self, path: str) -> bool:
        return self.left > 0 and f"checkpoint-{self.at}" in str(path)

    @contextlib.contextmanager
    def planted_save(self):
        """While active: the file ``save:<file>`` of ``checkpoint-<at>`` is left partial and the error raised."""
        import peft.peft_model
        import transformers.modeling_utils
        from transformers import TrainerState

        which = self.phase.split(":", 1)[1] if self.phase.startswith("save:") else None
        names = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "rng": "rng_state.pth"}
        saved = {"torch": torch.save, "hf": transformers.modeling_utils.safe_save_file,
                 "peft": peft.peft_model.safe_save_file, "state": TrainerState.save_to_json}

        def partial(path):
            with open(path, "wb") as f:
                f.write(b"\0" * 16)
            self.fire()

        def torch_save(obj, f, *args, **kwargs):
            if which in names and isinstance(f, (str, os.PathLike)) and str(f).endswith(names[which]) \
                    and self.save_due(f):
                partial(f)
            return saved["torch"](obj, f, *args, **kwargs)

        def safe_save(original):
            def save(tensors, filename, *args, **kwargs):
                if which == "model" and self.save_due(filename):
                    partial(filename)
                return original(tensors, filename, *args, **kwargs)
            return save

        def save_to_json(state, json_path):
            if which == "trainer_state" and self.save_due(json_path):
                partial(json_path)
            return saved["state"](state, json_path)

        torch.save = torch_save
        transformers.modeling_utils.safe_save_file = safe_save(saved["hf"])
        peft.peft_model.safe_save_file = safe_save(saved["peft"])
        TrainerState.save_to_json = save_to_json
        try:
            yield self
        finally:
            torch.save = saved["torch"]
            transformers.modeling_utils.safe_save_file = saved["hf"]
            peft.peft_model.safe_save_file = saved["peft"]
            TrainerState.save_to_json = saved["state"]


class SampleRecorder(TrainerCallback):
    """Which examples each optimizer step trained on (the rows of every training forward, padding removed). A step
    that began and was left (an error) is forgotten when a resume trains it again."""

    def __init__(self):
        self.by_step: dict[int, list[tuple]] = {}
        self.step = 0
        self.bus = None

    def attach(self, trainer):
        from hf_perf_callbacks.common.bus import bus_for

        inner = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        forward_entry(inner).register_forward_pre_hook(self.record, with_kwargs=True)
        self.bus = bus_for(trainer.callback_handler)     # the exactness check's passes train nothing: not recorded
        return trainer

    def record(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training and not self.bus.own_passes:
            ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
            positions = kwargs.get("position_ids")
            if mask is None and positions is not None:      # padding-free: one row of examples, each from position 0
                for row, starts in zip(ids.tolist(), positions.tolist()):
                    cuts = [i for i, p in enumerate(starts) if p == 0] + [len(row)]
                    for begin, end in zip(cuts, cuts[1:]):
                        self.by_step.setdefault(self.step + 1, []).append(tuple(row[begin:end]))
                return
            keep = mask.tolist() if mask is not None else [[1] * ids.shape[1]] * len(ids)
            for row, kept in zip(ids.tolist(), keep):
                self.by_step.setdefault(self.step + 1, []).append(tuple(t for t, k in zip(row, kept) if k))

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step
        for step in [s for s in self.by_step if s > state.global_step]:
            del self.by_step[step]

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def trained(self):
        return {step: sorted(rows) for step, rows in self.by_step.items()}


def rng_digest() -> str:
    """A digest of every RNG stream a step draws from (Python, NumPy, torch CPU)."""
    import hashlib
    import pickle
    import random

    import numpy as np

    numpy_state = np.random.get_state()
    return hashlib.sha256(pickle.dumps((random.getstate(), numpy_state[0], numpy_state[1].tobytes(),
                                        numpy_state[2:], torch.get_rng_state().numpy().tobytes()))).hexdigest()[:16]


class Trajectory(SampleRecorder):
    """What a run trained, to compare a recovered run with an unfaulted one: the examples of every optimizer step
    (GRPO: prompts and sampled completions), a digest of every RNG at each step's begin, and at the end the
    learning rate of every step, the weights and the optimizer state. A resume that continues another trainer's
    run (:meth:`continues`) takes that run's first steps."""

    def __init__(self):
        super().__init__()
        self.rng: dict[int, str] = {}
        self.rates: dict[int, float] = {}
        self.final: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, torch.Tensor] = {}

    def continues(self, earlier: Trajectory, at: int) -> Trajectory:
        """Take ``earlier``'s steps up to ``at`` (the checkpoint a new process resumed from)."""
        self.by_step.update({s: rows for s, rows in earlier.by_step.items() if s <= at})
        self.rng.update({s: d for s, d in earlier.rng.items() if s <= at})
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        for step in [s for s in self.rng if s > state.global_step]:
            del self.rng[step]

    def on_step_begin(self, args, state, control, **kwargs):
        self.rng[state.global_step + 1] = rng_digest()

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.rates = {h["step"]: h["learning_rate"] for h in state.log_history if "learning_rate" in h}
        self.final = weights(model)
        inner = getattr(optimizer, "optimizer", optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        self.optimizer = {f"{names.get(id(p), i)}.{key}": value.detach().to("cpu", copy=True)
                          for group in inner.param_groups for i, p in enumerate(group["params"])
                          for key, value in inner.state.get(p, {}).items() if torch.is_tensor(value)}


def differences(expected: Trajectory, got: Trajectory, rtol: float = 1e-4, atol: float = 1e-6) -> list[str]:
    """What ``got`` trained differently from ``expected`` (empty: the same samples, RNG stream, schedule, weights
    and optimizer state; weights and optimizer state within float summation order)."""
    found = []
    trained, wanted = got.trained(), expected.trained()
    if trained != wanted:
        steps = sorted(s for s in set(trained) | set(wanted) if trained.get(s) != wanted.get(s))
        found.append(f"other samples at steps {steps}")
    if got.rng != expected.rng:
        found.append(f"another RNG stream from step {min(s for s in expected.rng if got.rng.get(s) != expected.rng[s])}"
                     if set(got.rng) == set(expected.rng) else f"RNG recorded at steps {sorted(got.rng)}, expected "
                                                               f"{sorted(expected.rng)}")
    if got.rates != expected.rates:
        found.append(f"learning rates {got.rates} instead of {expected.rates}")
    for what, a, b in (("weights", expected.final, got.final), ("optimizer state", expected.optimizer, got.optimizer)):
        if set(a) != set(b) or not a:
            found.append(f"{what}: {len(b)} tensors instead of {len(a)}")
            continue
        worst = max(((b[k].double() - a[k].double()).abs().max().item(), k) for k in a)
        if not all(torch.allclose(b[k].double(), a[k].double(), rtol=rtol, atol=atol) for k in a):
            found.append(f"{what} differ (largest |difference| {worst[0]:.3g} in {worst[1]})")
    return found
