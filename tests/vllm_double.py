"""Test doubles of TRL's two vLLM backends, for driving a real ``GRPOTrainer(use_vllm=True)`` on CPU.

No machine this project uses has vLLM (it needs CUDA, and its wheel exceeds what the GPU machine can be given), so
these are **doubles built from the documented API** of TRL 1.16 and vLLM, not the engines:

* :class:`FakeVLLMClient` stands for ``trl.generation.vllm_client.VLLMClient`` (server mode) with the methods
  ``GRPOTrainer`` and ``VLLMGeneration`` call on it: ``__init__(base_url, group_port, connection_timeout)``,
  ``get_server_info()`` (``["model_config"]["logprobs_mode"]``), ``init_communicator(device)``,
  ``generate(prompts, features, n, ..., max_tokens, logprobs, ...)`` returning ``prompt_ids``, ``completion_ids``,
  ``logprobs`` and ``logprob_token_ids`` (``n`` completions per prompt, prompt-major), ``update_named_params(metadata,
  named_params)`` and ``update_named_param(name, weights)`` (the ``sync_weights`` path), ``reset_prefix_cache()``,
  ``close_communicator()``.
* :class:`FakeLLM` stands for ``vllm.LLM`` (colocate mode): ``generate(prompts, sampling_params, use_tqdm)``
  returning ``RequestOutput``-like objects (``prompt_token_ids``, ``outputs[i].token_ids``, ``outputs[i].logprobs``:
  one ``{token_id: Logprob(logprob, rank)}`` per token), ``reset_prefix_cache()``, ``sleep``/``wake_up`` and the
  weight loader TRL reaches through ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights``.

Each double spends planted time on the test's clock (a :class:`~tests.conftest.PlantedClock`) instead of working —
``generate_sec`` per generate call, ``tensor_sec`` per weight tensor synced — and returns completions of the lengths
it is given, recording what it spent and returned (:class:`EngineScript`) so a test can compare the meter's figures
with them. :func:`use_vllm_double` patches TRL's import check and names (``is_vllm_available``, ``VLLMClient``,
``LLM``, ``SamplingParams`` in ``trl.generation.vllm_generation``) for one test through ``monkeypatch``.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch


@dataclasses.dataclass
class EngineScript:
    """What the doubles are told to spend and return, and what they did (one entry per call)."""

    clock: object                       # a PlantedClock: the doubles spend on it
    generate_sec: float                 # planted seconds per generate call
    tensor_sec: float                   # planted seconds per weight tensor synced
    lengths: list[int]                  # completion lengths, used in turn (cycled)
    token_ids: list[int]                # the tokens a completion is made of (cycled)
    generate_calls: list[dict] = dataclasses.field(default_factory=list)   # {"completions", "tokens", "longest"}
    syncs: list[int] = dataclasses.field(default_factory=list)             # tensors per weight sync
    pending: int = 0                    # tensors loaded since the last sync ended
    _next: int = 0

    def completions(self, count: int) -> list[list[int]]:
        """``count`` completions of the scripted lengths, after spending one generate call's time."""
        self.clock.spend(self.generate_sec)
        rows = []
        for _ in range(count):
            length = self.lengths[self._next % len(self.lengths)]
            self._next += 1
            rows.append([self.token_ids[(self._next + i) % len(self.token_ids)] for i in range(length)])
        self.generate_calls.append({"completions": len(rows), "tokens": sum(map(len, rows)),
                                    "longest": max(map(len, rows))})
        return rows

    def load(self, tensors: int) -> None:
        """Weight tensors received (server: all in one call; colocate: one ``load_weights`` call each)."""
        self.clock.spend(self.tensor_sec * tensors)
        self.pending += tensors

    def sync_done(self) -> None:
        """TRL resets the prefix cache at the end of every ``sync_weights``, in both modes."""
        if self.pending:
            self.syncs.append(self.pending)
        self.pending = 0

    @property
    def sync_seconds(self) -> list[float]:
        return [self.tensor_sec * n for n in self.syncs]


class FakeVLLMClient:
    """``trl.generation.vllm_client.VLLMClient``, as TRL 1.16 documents and calls it (server mode)."""

    script: EngineScript                # set by use_vllm_double

    def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216, connection_timeout=0.0):
        self.base_url, self.group_port, self.communicator = base_url, group_port, None
        self.server_info_calls = 0

    def get_server_info(self) -> dict:
        self.server_info_calls += 1
        return {"model_config": {"logprobs_mode": "processed_logprobs"},
                "weight_transfer_config": {"backend": "nccl"}}

    def get_world_size(self) -> int:
        return 1

    def init_communicator(self, device=0) -> None:
        self.communicator = SimpleNamespace(device=device)

    def generate(self, prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None) -> dict:
        completions = self.script.completions(len(prompts) * n)
        return {"prompt_ids": [list(p) for p in prompts], "completion_ids": completions,
                "logprobs": [[[-1.0] for _ in row] for row in completions],
                "logprob_token_ids": [[[t] for t in row] for row in completions]}

    def update_named_params(self, metadata, named_params) -> None:
        self.script.load(sum(1 for _ in named_params))

    def update_named_param(self, name, weights) -> None:
        self.update_named_params([(name, str(weights.dtype), list(weights.shape))], iter([(name, weights)]))

    def reset_prefix_cache(self) -> None:
        self.script.sync_done()

    def close_communicator(self) -> None:
        self.communicator = None


class _Weights:
    """``llm_engine.model_executor.driver_worker.model_runner.model``: its ``load_weights`` (colocate sync)."""

    def __init__(self, script: EngineScript):
        self.script = script

    def load_weights(self, weights) -> None:
        self.script.load(len(list(weights)))


class FakeLLM:
    """``vllm.LLM`` as TRL 1.16's ``VLLMGeneration`` builds and calls it (colocate mode)."""

    script: EngineScript                # set by use_vllm_double

    def __init__(self, model=None, **settings):
        self.settings = settings
        runner = SimpleNamespace(model=_Weights(self.script))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)), model_config=SimpleNamespace(max_model_len=settings.get("max_model_len")))

    def generate(self, prompts, sampling_params=None, use_tqdm=False) -> list:
        n = getattr(sampling_params, "n", 1)
        rows = iter(self.script.completions(len(prompts) * n))
        outputs = []
        for prompt in prompts:
            done = [next(rows) for _ in range(n)]
            outputs.append(SimpleNamespace(prompt_token_ids=list(prompt["prompt_token_ids"]), outputs=[
                SimpleNamespace(token_ids=row, logprobs=[{t: SimpleNamespace(logprob=-1.0, rank=1)} for t in row])
                for row in done]))
        return outputs

    def reset_prefix_cache(self) -> None:
        self.script.sync_done()

    def sleep(self, level=1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass


class FakeSamplingParams:
    """``vllm.SamplingParams``: keeps its keyword arguments."""

    def __init__(self, **settings):
        self.__dict__.update(settings)


def use_vllm_double(monkeypatch, script: EngineScript) -> None:
    """Make ``trl.generation.vllm_generation`` build the doubles for this test (vLLM itself is not installed). A TRL
    whose ``VLLMGeneration.generate`` imports vLLM itself (TRL 1.0 of the oldest dependency set) cannot be given the
    doubles: the test is skipped there, saying so."""
    import inspect

    import pytest
    from trl.generation import vllm_generation

    source = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    if "from vllm" in source or "import vllm" in source:
        pytest.skip("this TRL's VLLMGeneration.generate imports vllm itself; the doubles stand for TRL 1.16's API")

    monkeypatch.setattr(FakeVLLMClient, "script", script, raising=False)
    monkeypatch.setattr(FakeLLM, "script", script, raising=False)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_generation, "VLLMClient", FakeVLLMClient)
    monkeypatch.setattr(vllm_generation, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", FakeSamplingParams, raising=False)
    if not torch.cuda.is_available():       # TRL 1.0 asks CUDA for the device the client's communicator joins
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29533")):
        monkeypatch.setenv(name, value)      # colocate mode sets them in os.environ: restored after the test
