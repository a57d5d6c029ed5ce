"""Stand-ins for vLLM at the boundary TRL's own code meets it, for driving real TRL trainers on a CPU.

No machine this project uses has vLLM (it needs CUDA). What is stood in, and why:

* **the server** (``vllm serve``): :class:`StandInServer`, a real HTTP server on 127.0.0.1 bound to port 0 (each run
  its own port) in a daemon thread, answering the endpoints TRL's clients call (``/health``, ``/v1/models``,
  ``/server_info``, ``/get_world_size``, ``/v1/completions``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/reset_prefix_cache``, ``/pause``,
  ``/resume``). TRL's real clients talk to it: ``trl.generation.vllm_client.VLLMClient`` (``requests``, its
  completions payload, ``parse_logprobs``) and async GRPO's client and ``aiohttp`` rollout worker. Completions honour
  ``n`` and ``max_tokens``: a scripted length below ``max_tokens`` ends with the EOS token (``finish_reason``
  ``stop``), a longer one is cut at ``max_tokens`` (``length``).
* **vLLM's NCCL weight-transfer engine** (``vllm.distributed.weight_transfer``: ``trainer_init`` and
  ``packed_nccl_broadcast_producer``, which TRL imports only when vLLM is installed): it needs CUDA devices, so TRL
  1.16's ``VLLMClient.init_communicator`` refuses a CPU device before any HTTP call (tests show the refusal). The
  stand-in producer hands each tensor TRL streams (its own iteration: PEFT merge and unmerge, ZeRO-3 gathers) to the
  server in this process, which checks it against the ``update_info`` metadata of its ``/update_weights`` request
  (names, dtypes, shapes; a mismatch is an HTTP 500) and spends ``tensor_sec`` per tensor. To reach that path on a
  CPU the tests hand ``init_communicator`` the device a CUDA machine would (``"cuda"`` without an index: TRL then
  calls no ``torch.cuda`` function); everything else of it runs as written.
* **``vllm.LLM``** (colocate): :class:`StandInLLM` loads the parameter names and shapes of the checkpoint TRL names
  (``model.name_or_path``: the tests train a model saved to a folder), checks every weight ``load_weights`` receives
  against them, and models sleep mode: ``sleep(level=2)`` discards the weights and ``generate`` refuses to run until
  every weight was loaded again (TRL then syncs from inside ``VLLMGeneration.generate``).

Costs are spent by :class:`EngineScript`: ``generate_sec`` per engine call (one ``/v1/completions`` request, one
``LLM.generate``) and ``tensor_sec`` per weight tensor received, in real time (``time.sleep``) or, where a test needs
an exact figure in one process, on the test's :class:`~tests.conftest.PlantedClock`. :func:`stand_in` sets the names
TRL imports from vLLM for one test (``monkeypatch.setattr``) or one launched rank (``setattr``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch


@dataclasses.dataclass
class EngineScript:
    """What the stand-ins are told to spend and return, and what they did (one entry per call)."""

    generate_sec: float                 # seconds per engine call
    tensor_sec: float                   # seconds per weight tensor received
    lengths: list[int]                  # scripted completion lengths, used in turn (cycled)
    token_ids: list[int]                # the tokens a completion is made of (cycled; never the EOS token)
    eos_token_id: int = 0
    clock: object = None                # a PlantedClock to spend on, or None: real time
    generate_calls: list[dict] = dataclasses.field(default_factory=list)   # {"completions", "tokens", "longest"}
    syncs: list[int] = dataclasses.field(default_factory=list)             # tensors per weight sync
    pending: int = 0                    # tensors received since the last sync ended
    _next: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def spend(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.spend(seconds)
        else:
            time.sleep(seconds)

    def completions(self, count: int, max_tokens: int) -> list[list[int]]:
        """``count`` completions of the scripted lengths (cut at ``max_tokens``; a shorter one ends with EOS), after
        spending one engine call's time."""
        self.spend(self.generate_sec)
        rows = []
        with self._lock:
            for _ in range(count):
                length = self.lengths[self._next % len(self.lengths)]
                self._next += 1
                body = [self.token_ids[(self._next + i) % len(self.token_ids)] for i in range(min(length, max_tokens))]
                rows.append(body if length >= max_tokens else body[:length - 1] + [self.eos_token_id])
            self.generate_calls.append({"completions": len(rows), "tokens": sum(map(len, rows)),
                                        "longest": max(map(len, rows))})
        return rows

    def received(self, tensors: int) -> None:
        self.spend(self.tensor_sec * tensors)
        self.pending += tensors

    def sync_done(self) -> None:
        """The end of one weight sync (TRL resets the prefix cache, or finishes the weight update)."""
        if self.pending:
            self.syncs.append(self.pending)
        self.pending = 0

    @property
    def sync_seconds(self) -> list[float]:
        return [self.tensor_sec * n for n in self.syncs]


# ---------------------------------------------------------------- the server
_ENDPOINTS: dict[tuple[str, int], StandInServer] = {}     # the weight-transfer group's address → its server
_PORTS = itertools.count(40000)           # get_open_port: a name for a group (no socket is opened: no fixed port)


class StandInServer:
    """``vllm serve`` on 127.0.0.1, port 0, in a daemon thread (``with StandInServer(...) as server``)."""

    def __init__(self, script: EngineScript, model: str = "stand-in", max_model_len: int = 512,
                 dtype: str = "float32", world_size: int = 1):
        self.script, self.model, self.max_model_len = script, model, max_model_len
        self.dtype, self.world_size = dtype, world_size
        self.channel: queue.Queue = queue.Queue()         # tensors from the stand-in NCCL producer
        self.requests: list[str] = []                      # every request's path, in order
        self.updates: list[dict] = []                      # every /update_weights' update_info
        self.paused = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="stand-in vllm server")

    def __enter__(self) -> StandInServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for key in [k for k, server in _ENDPOINTS.items() if server is self]:    # its group is gone with it
            del _ENDPOINTS[key]

    # the endpoints: (status, JSON body)
    def get(self, path: str) -> tuple[int, dict]:
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {"data": [{"id": self.model, "max_model_len": self.max_model_len}]}
        if path == "/server_info":
            return 200, {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs",
                                                          "dtype": f"torch.{self.dtype}"},
                                         "weight_transfer_config": {"backend": "nccl"}, "lora_config": None}}
        if path == "/get_world_size":
            return 200, {"world_size": self.world_size}
        return 404, {"error": path}

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/v1/completions":
            return 200, self.completions(body)
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            _ENDPOINTS[(info["master_address"], info["master_port"])] = self
            return 200, {}
        if path == "/update_weights":
            return self.update_weights(body["update_info"])
        if path in ("/reset_prefix_cache", "/finish_weight_update"):
            self.script.sync_done()
            return 200, {"success": True}
        if path in ("/start_weight_update", "/pause", "/resume"):
            self.paused = path == "/pause"
            return 200, {}
        return 404, {"error": path}

    def completions(self, body: dict) -> dict:
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens", 16))
        rows = iter(self.script.completions(len(prompts) * n, max_tokens))
        choices = []
        for prompt in prompts:
            for _ in range(n):
                ids = next(rows)
                choices.append({"index": len(choices), "prompt_token_ids": list(prompt), "token_ids": ids,
                                "finish_reason": "stop" if ids[-1] == self.script.eos_token_id else "length",
                                "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                             "token_logprobs": [-1.0] * len(ids),
                                             "top_logprobs": [{f"token_id:{t}": -1.0} for t in ids]}})
        return {"id": "cmpl-stand-in", "model": body.get("model"), "choices": choices}

    def update_weights(self, info: dict) -> tuple[int, dict]:
        """Receive the tensors ``info`` announces from the producer, each checked against its metadata."""
        self.updates.append(info)
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
            try:
                tensor = self.channel.get(timeout=30)
            except queue.Empty:
                return 500, {"error": f"no tensor arrived for {name}"}
            if str(tensor.dtype).removeprefix("torch.") != dtype or list(tensor.shape) != list(shape):
                return 500, {"error": f"{name}: got {tensor.dtype} {list(tensor.shape)}, announced {dtype} {shape}"}
        self.script.received(len(info["names"]))          # the transfer's cost, once it is all there
        return 200, {}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:       # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                server.requests.append(path)
                self._answer(*server.get(path))

            def do_POST(self) -> None:
                path = self.path.split("?")[0]
                server.requests.append(path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                self._answer(*server.post(path, body))

        return Handler


# ---------------------------------------------------------------- vLLM's NCCL weight-transfer engine, stood in
def trainer_init(init_info: dict) -> SimpleNamespace:
    """``vllm.distributed.weight_transfer.nccl_common.trainer_init``: the trainer's side of the group, found by the
    address the server was told in ``/init_weight_transfer_engine`` (sent at the same time from another thread)."""
    key = (init_info["master_address"], init_info["master_port"])
    deadline = time.monotonic() + 60
    while key not in _ENDPOINTS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no stand-in server joined the weight-transfer group {key}")
        time.sleep(0.01)
    return SimpleNamespace(server=_ENDPOINTS[key], group=SimpleNamespace(store=object(), socket=object()))


def packed_nccl_broadcast_producer(iterator, group, src=0, post_iter_func=lambda item: item[1]) -> None:
    """``vllm.distributed.weight_transfer.packed_tensor.packed_nccl_broadcast_producer``: every tensor of TRL's
    iterator to the server (a copy, as a broadcast receives one)."""
    for item in iterator:
        group.server.channel.put(post_iter_func(item).detach().to("cpu", copy=True))


# ---------------------------------------------------------------- vllm.LLM (colocate)
class StandInSamplingParams:
    """``vllm.SamplingParams``: keeps its keyword arguments."""

    def __init__(self, **settings):
        self.n, self.max_tokens = 1, 16
        self.__dict__.update(settings)


class StandInLLM:
    """``vllm.LLM`` as TRL 1.16's ``VLLMGeneration`` builds and calls it (colocate mode)."""

    script: EngineScript                # set by stand_in
    built: list[StandInLLM] = []        # every engine built (a test reads what it did)

    def __init__(self, model=None, enable_sleep_mode=False, **settings):
        from safetensors.torch import load_file

        if not model:
            raise ValueError("vllm.LLM needs the model's name or path (TRL passes model.name_or_path)")
        import glob
        import os

        files = glob.glob(os.path.join(model, "*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors checkpoint in {model!r}")
        self.shapes = {k: list(v.shape) for f in files for k, v in load_file(f).items()}
        self.settings, self.enable_sleep_mode = settings, enable_sleep_mode
        self.loaded: set[str] = set(self.shapes)          # the checkpoint's weights, until level-2 sleep drops them
        self.sleeps, self.wake_ups, self.loads = 0, [], 0
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self.load_weights))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)), model_config=SimpleNamespace(max_model_len=settings.get("max_model_len")))
        StandInLLM.built.append(self)

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name in self.shapes and self.shapes[name] != list(tensor.shape):
                raise ValueError(f"{name}: shape {list(tensor.shape)}, the engine's is {self.shapes[name]}")
            if name not in self.shapes and name != "lm_head.weight":     # tied embeddings: no lm_head file entry
                raise KeyError(f"{name} is no weight of the engine's model")
            self.loaded.add(name)
            self.loads += 1
            self.script.received(1)

    def generate(self, prompts, sampling_params=None, use_tqdm=False) -> list:
        missing = set(self.shapes) - self.loaded
        if missing:
            raise RuntimeError(f"generate with {len(missing)} weights discarded by sleep (level 2), e.g. "
                               f"{sorted(missing)[0]}")
        n, max_tokens = int(getattr(sampling_params, "n", 1)), int(getattr(sampling_params, "max_tokens", 16))
        rows = iter(self.script.completions(len(prompts) * n, max_tokens))
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
        self.sleeps += 1
        if level == 2:
            self.loaded = set()

    def wake_up(self, tags=None) -> None:
        self.wake_ups.append(tags)


# ---------------------------------------------------------------- the names TRL imports from vLLM
def stand_in(monkeypatch, script: EngineScript) -> None:
    """Set, through ``monkeypatch`` (a test's; None in a launched rank: plain ``setattr``), the names TRL 1.16
    imports from vLLM when it is installed, to the stand-ins above; and hand
    ``init_communicator`` the device a CUDA machine would (see the module's docstring). A TRL whose
    ``VLLMGeneration.generate`` imports vLLM itself (TRL 1.0 of the oldest set) cannot be given them: the caller
    skips (:func:`supported`)."""
    from trl.generation import vllm_client, vllm_generation

    def setattr_(obj, name, value):
        if monkeypatch is None:
            setattr(obj, name, value)
        else:
            monkeypatch.setattr(obj, name, value, raising=False)     # TRL skipped its vLLM imports: new names

    StandInLLM.script = script
    StandInLLM.built = []
    for module in (vllm_client, vllm_generation):
        setattr_(module, "is_vllm_available", lambda *a, **k: True)
    setattr_(vllm_client, "get_ip", lambda: "127.0.0.1")
    setattr_(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    setattr_(vllm_client, "_HAS_RESET_PREFIX_CACHE_SUCCESS", True)
    setattr_(vllm_client, "open_trainer_endpoint", trainer_init)
    setattr_(vllm_client, "packed_nccl_broadcast_producer", packed_nccl_broadcast_producer)
    setattr_(vllm_generation, "LLM", StandInLLM)
    setattr_(vllm_generation, "SamplingParams", StandInSamplingParams)
    refusing = vllm_client.VLLMClient.init_communicator

    def init_communicator(self, device=0):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return refusing(self, device="cuda" if device.type == "cpu" else device)

    init_communicator.trl_own = refusing
    setattr_(vllm_client.VLLMClient, "init_communicator", init_communicator)


def supported() -> str | None:
    """Why this TRL cannot be driven through the stand-ins (None: it can)."""
    import inspect

    try:
        from trl.generation import vllm_client, vllm_generation
    except ImportError:
        return "this TRL has no trl.generation.vllm_client (TRL 1.16's API)"
    source = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    if "from vllm" in source or "import vllm" in source or not hasattr(vllm_client, "parse_logprobs"):
        return "this TRL's vLLM code differs from TRL 1.16's, whose boundary the stand-ins take"
    return None


def colocate_env(monkeypatch) -> None:
    """Colocate mode sets the rank variables and a free ``MASTER_PORT`` (TRL's ``ensure_master_addr_port``) in
    ``os.environ``: restored after the test."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")        # recorded as it was (absent too), so the undo removes what TRL sets
        monkeypatch.delenv(name)


