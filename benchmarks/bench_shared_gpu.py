"""A shared card: the memory wall where the device really has it, with a planted leak of 512 MiB a step.

Three runs of a plain ``transformers.Trainer`` (a full fine-tune of a Qwen2.5-0.5B-shaped model with random weights,
bf16, 64-token sequences; no TRL, no ``datasets``) on one NVIDIA GPU, each with a callback that keeps a new 512 MiB
CUDA tensor alive every step and ``MemoryWatchdog()`` with its defaults:

- ``a_other_process``: another process holds all of the card but ``--leave_gb`` (20 GiB);
- ``b_outside_allocator``: this process holds the same amount outside PyTorch's caching allocator, as vLLM's pool
  does: ``cudaMalloc`` through ctypes on the ``libcudart`` torch has loaded (the driver's ``cuMemAlloc`` when no
  libcudart is mapped);
- ``c_tuning``: ``a`` under ``train_with_tuning`` with ``AdaptiveBatchTuner(tune=False)`` at 4×2: a leak and another
  tenant must cause no re-size, and the stop names both.

- ``d_wall_moves``: no leak; a 16×1 run of 256-token rows (CPU smoke: 8×1, 64 tokens); at the end of step 10 another
  process takes all the free memory but ``--moved_leave_gb`` (0.5 GiB), and the rows of step 11 on are twice as long.
  ``MemoryWatchdog()`` alone must end with a checkpoint of step 10 (the last completed step), a stop naming the other
  process and no out-of-memory error;
- ``e_wall_moves_tuning``: ``d`` under ``train_with_tuning`` (``AdaptiveBatchTuner(tune=False)``): a re-size before or
  at the out-of-memory error, and ``max_steps`` reached.
- ``f_slow_leak``: ``a`` with a slow leak (``--slow_leak_mb``, 32 MiB a step) and the other process leaving
  ``--slow_leave_gb`` (8 GiB): the stop, its checkpoint and the leak named, no out-of-memory error;
- ``g_tenant_returns``: the rows of ``d`` at their first length throughout; at the end of step 6 another process takes
  all the free memory but ``--returns_leave_gb`` (16 GiB) and gives it back at the end of step 12: ``max_steps``
  reached with no stop and no re-size (``MemoryWatchdog()`` alone), the budget back up after the tenant left;
- ``h_tenant_returns_tuning``: ``g`` under ``train_with_tuning``: no re-size either.

Runs ``a``-``d`` and ``f`` must end with a checkpoint written by the watchdog's stop and no out-of-memory error.
Recorded per run in ``benchmarks/results/shared_gpu.json``: the device, date and versions, the budget per step
(``mem/limit_gb``) with ``used`` and ``mem/outside_gb``, the budget the watchdog used to take (85% of the card), the
stop step, whether the checkpoint is there, the OOM (if any), the watchdog's events (the wall at the start, the
leak, the stop) and the tuner's decisions. About 4 minutes on one H200.

    python benchmarks/bench_shared_gpu.py            # one NVIDIA GPU
    python benchmarks/bench_shared_gpu.py --smoke    # CPU stand-ins: a process holding 512 MiB, memory this process
                                                     # holds outside torch (libc malloc), a 64 MiB leak, the tiny
                                                     # model and a budget fraction that puts the wall 18 leaks away;
                                                     # d and e on a machine of this process and the tenant alone
                                                     # (:class:`SmallMachine`)
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
from common import GB, table, write_result
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, train_with_tuning
from hf_perf_callbacks.platform.device import DeviceLayer
from hf_perf_callbacks.tiny import build_model, build_tokenizer

MIB = 2**20

#: the other process: holds ``size`` bytes (CUDA: one tensor; CPU: a bytearray with every page touched) until told;
#: a negative ``size`` on CUDA: all the free memory but ``-size`` bytes once its own CUDA context is up
HOLDER = textwrap.dedent("""
    import sys
    size, device = int(sys.argv[1]), sys.argv[2]
    if device == "cuda":
        import torch
        torch.cuda.init()
        torch.empty(1, device="cuda")
        size = size if size > 0 else torch.cuda.mem_get_info()[0] + size
        held = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
    else:
        held = bytearray(size)
        held[::4096] = b"\\x01" * len(range(0, size, 4096))
    print("held", flush=True)
    sys.stdin.readline()
""")


class OtherProcess:
    """Another process holding ``size`` bytes of the card (or the machine)."""

    def __init__(self, size: int, device: str):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(size), device], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "held":
            self.close()
            raise RuntimeError(f"the other process could not take {size / GB:.1f} GiB (it said {line!r})")

    def close(self) -> None:
        try:
            assert self.process.stdin is not None
            self.process.stdin.write("\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired, AssertionError):
            self.process.kill()
            self.process.wait(timeout=60)


def hold_outside_torch(size: int, device: str) -> tuple[object, str]:
    """Memory this process holds outside PyTorch's caching allocator: (a function that frees it, how it was taken).
    CUDA: ``cudaMalloc`` of the libcudart torch has loaded, else the driver's ``cuMemAlloc_v2`` in torch's current
    context; CPU (smoke): libc ``malloc`` with every page written."""
    if device == "cpu":
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc.restype = ctypes.c_void_p
        pointer = libc.malloc(ctypes.c_size_t(size))
        if not pointer:
            raise MemoryError(f"malloc({size}) failed")
        ctypes.memset(pointer, 1, size)
        return (lambda: libc.free(ctypes.c_void_p(pointer))), "libc malloc"
    torch.cuda.init()
    torch.empty(1, device="cuda")                 # the primary context is current on this thread
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line})
    if mapped:
        cudart = ctypes.CDLL(mapped[0])
        pointer = ctypes.c_void_p()
        rc = cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size))
        if rc != 0:
            raise RuntimeError(f"cudaMalloc({size}) returned {rc}")
        return (lambda: cudart.cudaFree(pointer)), f"cudaMalloc ({os.path.basename(mapped[0])})"
    cuda = ctypes.CDLL("libcuda.so.1")
    device_pointer = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(device_pointer), ctypes.c_size_t(size))
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc_v2({size}) returned {rc}")
    return (lambda: cuda.cuMemFree_v2(device_pointer)), "cuMemAlloc_v2 (libcuda.so.1: no libcudart mapped)"


class Leak(TrainerCallback):
    """Keeps a new ``size``-byte tensor alive every step (tensors kept across steps)."""

    def __init__(self, size: int, device: str):
        self.size, self.device, self.kept = size, device, []

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(self.size, dtype=torch.uint8, device=self.device))


class Tokens(torch.utils.data.Dataset):
    """Fixed-length random token sequences (no padding, no ``datasets``)."""

    def __init__(self, vocab: int, n: int = 4096, length: int = 64):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(8, vocab, (n, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(kind: str, device: str):
    """``qwen05``: Qwen2.5-0.5B's shape (24 layers, hidden 896, vocab 151,936) in bf16; ``tiny``: the tests' model."""
    from hf_perf_callbacks.tasks import wordle

    tok = build_tokenizer(wordle.load_words(), vocab_size=400)
    if kind == "tiny":
        return build_model(tok, hidden=64, layers=2, heads=2).to(device), len(tok)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    with torch.device(device):                   # initialised on the GPU: seconds, not a CPU minute
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=torch.bfloat16), len(tok)


def budget_fraction_for(headroom: int) -> float:
    """CPU (smoke): the fraction of what the run can reach that puts the wall ``headroom`` bytes above this process's
    memory now (the budget stays the watchdog's own reading)."""
    import psutil

    gc.collect()
    rss = psutil.Process().memory_info().rss
    return (rss + headroom) / (rss + psutil.virtual_memory().available)


def train_and_catch(trainer, tuning: bool) -> tuple[float, str | None, str | None]:
    """Train (``train_with_tuning`` when ``tuning``); returns the seconds, the out-of-memory error's first line (None:
    none) and any other error that ended the run (None: none): the benchmark reports what ended it."""
    started, oom, error = time.perf_counter(), None, None
    try:
        train_with_tuning(trainer) if tuning else trainer.train()
    except torch.OutOfMemoryError as failure:
        oom = str(failure).splitlines()[0][:300]
    except Exception as failure:  # noqa: BLE001 - recorded: the benchmark reports what ended the run
        error = f"{type(failure).__name__}: {str(failure)[:600]}"
        if "out of memory" in str(failure).lower():
            oom = error
    return time.perf_counter() - started, oom, error


def read_log(out: str, fields: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """The run's step lines and its watchdog's and tuner's events (``fields`` of each) from its perf log."""
    lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
    events = [{k: x.get(k) for k in fields} for x in lines if x["type"] == "event" and x["source"] in ("mem", "tuner")]
    return [x for x in lines if x["type"] == "step"], events


def one_run(name: str, a, device: str, tuning: bool, leak_mb: int | None = None, steps: int | None = None) -> dict:
    out = tempfile.mkdtemp(prefix=f"shared_gpu_{name}_")
    model, vocab = make_model(a.model, device)
    leak_mb, steps = leak_mb or a.leak_mb, steps or a.steps
    leak = Leak(leak_mb * MIB, device)
    watchdog = (MemoryWatchdog() if device == "cuda"
                else MemoryWatchdog(budget_fraction=budget_fraction_for(18 * leak_mb * MIB)))
    tuner = AdaptiveBatchTuner(tune=False) if tuning else None
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, seed=0, use_cpu=device == "cpu",
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(vocab),
                      callbacks=[leak, watchdog] + ([tuner] if tuner else []))
    seconds, oom, error = train_and_catch(trainer, tuning)
    steps, events = read_log(out, ("step", "kind", "action", "message"))
    stop = watchdog.stopped_at
    stop_message = next((e["message"] for e in reversed(events) if e["kind"] == "stop"), None)
    decisions = [{"kind": d.kind, "step": d.step, "old": str(d.old), "new": str(d.new), "reason": d.reason}
                 for d in (tuner.executor.record.decisions if tuner and tuner.executor else [])]
    total = DeviceLayer(device).memory().total or 0
    result = {
        "run": name, "seconds": seconds, "steps_trained": trainer.state.global_step, "max_steps": args.max_steps,
        "stop_step": stop, "checkpoint": bool(stop) and os.path.isdir(os.path.join(out, f"checkpoint-{stop}")),
        "oom": oom, "error": error, "leak_mib_per_step": leak_mb,
        "device_total_gb": total / GB,
        "old_budget_gb": 0.85 * total / GB if device == "cuda" else None,   # 85% of the card: what it used to be
        "budget_per_step": [{"step": s["step"], "limit_gb": s.get("mem/limit_gb"),
                             "used_gb": s.get("mem/device_used_gb"), "outside_gb": s.get("mem/outside_gb")}
                            for s in steps],
        "used_at_stop_gb": next((s.get("mem/device_used_gb") for s in steps if s["step"] == stop), None),
        "budget_at_stop_gb": next((s.get("mem/limit_gb") for s in steps if s["step"] == stop), None),
        "stop_message": stop_message, "events": events, "tuner_decisions": decisions,
        "memory_resizes": sum(d["kind"] in ("oom", "watchdog") for d in decisions),
        "stop_names_leak": bool(stop_message and "a leak of" in stop_message),
        "stop_names_outside": bool(stop_message and ("another process" in stop_message
                                                     or "outside PyTorch's" in stop_message
                                                     or "other processes" in stop_message)),
    }
    result["passed"] = bool(result["checkpoint"] and not oom and not error and stop is not None
                            and (not tuning or result["memory_resizes"] == 0))
    leak.kept.clear()
    del trainer, model, watchdog, tuner, leak
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


class Longer:
    """A collator of fixed-length rows cut to half their length until ``full`` is set (the run's rows grow)."""

    def __init__(self):
        self.full = False

    def __call__(self, examples):
        ids = torch.stack([e["input_ids"] for e in examples])
        ids = ids if self.full else ids[:, : ids.shape[1] // 2]
        return {"input_ids": ids, "labels": ids.clone()}


class SmallMachine(DeviceLayer):
    """CPU smoke: a machine of ``size`` bytes that this process and the tenant alone share. Its memory reading is the
    real CPU one with the machine's total and available memory taken from the two processes' real resident memory
    (psutil), so the tenant moves the wall as it would on a machine that small, whatever else this host runs."""

    def __init__(self, size: int):
        super().__init__("cpu")
        self.size, self.tenant = size, None

    def memory(self):
        import dataclasses

        import psutil

        sample = super().memory()
        tenant = psutil.Process(self.tenant).memory_info().rss if self.tenant else 0
        own = psutil.Process().memory_info().rss
        return dataclasses.replace(sample, system_total=self.size, device_limit=self.size,
                                   system_available=max(0, self.size - own - tenant))


class TakeTheCard(TrainerCallback):
    """At the end of step ``at`` (before the watchdog reads it) another process takes all of the free memory but
    ``leave`` bytes (CPU smoke: ``leave`` below what the small machine has free); the rows of steps from ``at + 1`` on
    are full length (accelerate's dataloader collates one batch ahead, so the collator knows two steps before)."""

    def __init__(self, at: int, leave: int, device: str, collator: Longer, machine: SmallMachine | None):
        self.at, self.leave, self.device, self.collator, self.machine = at, leave, device, collator, machine
        self.other: OtherProcess | None = None
        self.taken_gb: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        self.collator.full = self.collator.full or state.global_step >= self.at - 1
        if state.global_step != self.at or self.other is not None:
            return
        if self.device == "cuda":                  # all the free memory but ``leave``, its own context counted
            self.other = OtherProcess(-self.leave, self.device)
            self.taken_gb = (torch.cuda.get_device_properties(0).total_memory - torch.cuda.mem_get_info()[0]
                             - torch.cuda.memory_reserved()) / GB
        else:
            size = int(self.machine.memory().system_available - self.leave)
            self.other = OtherProcess(size, self.device)
            self.machine.tenant = self.other.process.pid
            self.taken_gb = size / GB

    def close(self) -> None:
        if self.other is not None:
            self.other.close()


def moving_wall_run(name: str, a, device: str, tuning: bool) -> dict:
    out = tempfile.mkdtemp(prefix=f"shared_gpu_{name}_")
    model, vocab = make_model(a.model, device)
    micro, length = (16, 512) if device == "cuda" else (8, 128)
    collator = Longer()
    machine = None
    if device == "cpu":
        import psutil

        gc.collect()
        machine = SmallMachine(psutil.Process().memory_info().rss + 1536 * MIB)
    take = TakeTheCard(10, int(a.moved_leave_gb * GB) if device == "cuda" else 64 * MIB, device, collator, machine)
    watchdog = MemoryWatchdog()
    if machine is not None:
        watchdog.device = machine
    tuner = AdaptiveBatchTuner(tune=False) if tuning else None
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=1,
                             max_steps=a.moved_steps, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, seed=0, use_cpu=device == "cpu",
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(vocab, length=length), data_collator=collator,
                      callbacks=[take, watchdog] + ([tuner] if tuner else []))
    try:
        seconds, oom, error = train_and_catch(trainer, tuning)
    finally:
        take.close()
    steps, events = read_log(out, ("step", "kind", "action", "message", "need_gb", "budget_gb"))
    stop = watchdog.stopped_at
    stop_message = next((e["message"] for e in reversed(events) if e["kind"] == "stop"), None)
    decisions = [{"kind": d.kind, "step": d.step, "old": str(d.old), "new": str(d.new), "reason": d.reason}
                 for d in (tuner.executor.record.decisions if tuner and tuner.executor else [])]
    result = {
        "run": name, "seconds": seconds, "steps_trained": trainer.state.global_step, "max_steps": a.moved_steps,
        "split": f"{micro}x1", "rows": f"{length // 2} tokens, {length} from step 11", "taken_at_step": take.at,
        "taken_gb": take.taken_gb, "left_gb": (a.moved_leave_gb if device == "cuda" else 64 * MIB / GB),
        "stop_step": stop, "checkpoint": bool(stop) and os.path.isdir(os.path.join(out, f"checkpoint-{stop}")),
        "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")),
        "oom": oom, "error": error,
        "budget_per_step": [{"step": s["step"], "limit_gb": s.get("mem/limit_gb"),
                             "used_gb": s.get("mem/device_used_gb"), "outside_gb": s.get("mem/outside_gb")}
                            for s in steps],
        "stop_message": stop_message, "events": events, "tuner_decisions": decisions,
        "memory_resizes": sum(d["kind"] in ("oom", "watchdog") for d in decisions),
        "stop_names_outside": bool(stop_message and ("another process" in stop_message
                                                     or "other processes" in stop_message)),
    }
    if tuning:     # CPU smoke: a smaller micro-batch does not give resident memory back, so a stop may follow
        ended = trainer.state.global_step == a.moved_steps or (device == "cpu" and result["checkpoint"])
        result["passed"] = bool(not error and not oom and result["memory_resizes"] >= 1 and ended)
    else:
        result["passed"] = bool(not oom and not error and stop == take.at and result["checkpoint"]
                                and result["stop_names_outside"])
    del trainer, model, watchdog, tuner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


class LendTheCard(TrainerCallback):
    """At the end of step ``take`` another process takes all the free memory but ``leave`` bytes; at the end of step
    ``give`` it gives it back (CPU smoke: of the small machine)."""

    def __init__(self, take: int, give: int, leave: int, device: str, machine: SmallMachine | None):
        self.take, self.give, self.leave, self.device, self.machine = take, give, leave, device, machine
        self.other: OtherProcess | None = None
        self.taken_gb: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.take and self.other is None:
            size = -self.leave if self.device == "cuda" else int(self.machine.memory().system_available - self.leave)
            self.other = OtherProcess(size, self.device)
            if self.machine is not None:
                self.machine.tenant = self.other.process.pid
            self.taken_gb = ((torch.cuda.get_device_properties(0).total_memory - torch.cuda.mem_get_info()[0]
                              - torch.cuda.memory_reserved()) / GB if self.device == "cuda" else size / GB)
        elif state.global_step == self.give:
            self.close()

    def close(self) -> None:
        if self.other is not None:
            self.other.close()
            self.other = None
            if self.machine is not None:
                self.machine.tenant = None


def returning_tenant_run(name: str, a, device: str, tuning: bool) -> dict:
    out = tempfile.mkdtemp(prefix=f"shared_gpu_{name}_")
    model, vocab = make_model(a.model, device)
    micro, length = (16, 256) if device == "cuda" else (8, 64)
    machine = None
    if device == "cpu":
        import psutil

        gc.collect()
        machine = SmallMachine(psutil.Process().memory_info().rss + 1536 * MIB)
    leave = int(a.returns_leave_gb * GB) if device == "cuda" else 768 * MIB
    lend = LendTheCard(6, 12, leave, device, machine)
    watchdog = MemoryWatchdog()
    if machine is not None:
        watchdog.device = machine
    tuner = AdaptiveBatchTuner(tune=False) if tuning else None
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=1,
                             max_steps=18, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, seed=0, use_cpu=device == "cpu",
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(vocab, length=length),
                      callbacks=[lend, watchdog] + ([tuner] if tuner else []))
    try:
        seconds, oom, error = train_and_catch(trainer, tuning)
    finally:
        lend.close()
    steps, events = read_log(out, ("step", "kind", "action", "message"))
    decisions = [{"kind": d.kind, "step": d.step, "old": str(d.old), "new": str(d.new), "reason": d.reason}
                 for d in (tuner.executor.record.decisions if tuner and tuner.executor else [])]
    limits = {s["step"]: s.get("mem/limit_gb") for s in steps}
    result = {
        "run": name, "seconds": seconds, "steps_trained": trainer.state.global_step, "max_steps": 18,
        "split": f"{micro}x1", "rows": f"{length // 2}..{length} tokens", "taken_at_step": lend.take,
        "given_back_at_step": lend.give, "taken_gb": lend.taken_gb, "left_gb": leave / GB,
        "stop_step": watchdog.stopped_at, "oom": oom, "error": error, "events": events, "tuner_decisions": decisions,
        "actions": [x.action for x in watchdog.actions],
        "budget_per_step": [{"step": s["step"], "limit_gb": s.get("mem/limit_gb"),
                             "used_gb": s.get("mem/device_used_gb"), "outside_gb": s.get("mem/outside_gb")}
                            for s in steps],
        "budget_before_gb": limits.get(lend.take - 1), "budget_held_gb": limits.get(lend.take + 1),
        "budget_after_gb": limits.get(lend.give + 1),
        "memory_resizes": sum(d["kind"] in ("oom", "watchdog") for d in decisions),
        "stop_names_outside": False, "checkpoint": False,
    }
    came_back = (result["budget_after_gb"] is not None and result["budget_held_gb"] is not None
                 and result["budget_after_gb"] > result["budget_held_gb"])
    result["passed"] = bool(not oom and not error and watchdog.stopped_at is None and result["memory_resizes"] == 0
                            and trainer.state.global_step == 18 and came_back)
    del trainer, model, watchdog, tuner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave_gb", type=float, default=20.0, help="what the other tenant leaves of the card (GiB)")
    p.add_argument("--leak_mb", type=int, default=512, help="the planted leak, MiB a step")
    p.add_argument("--steps", type=int, default=80, help="max_steps (beyond the wall: without a stop, an OOM)")
    p.add_argument("--model", choices=["qwen05", "tiny"], default="qwen05")
    p.add_argument("--runs", nargs="+", default=list("abcdefgh"), choices=list("abcdefgh"))
    p.add_argument("--moved_leave_gb", type=float, default=0.5, help="d, e: what the other process leaves (GiB)")
    p.add_argument("--moved_steps", type=int, default=16, help="d, e: max_steps")
    p.add_argument("--slow_leak_mb", type=int, default=32, help="f: the slow leak, MiB a step")
    p.add_argument("--slow_leave_gb", type=float, default=8.0, help="f: what the other process leaves (GiB)")
    p.add_argument("--slow_steps", type=int, default=400, help="f: max_steps")
    p.add_argument("--returns_leave_gb", type=float, default=16.0, help="g, h: what the lending process leaves (GiB)")
    p.add_argument("--smoke", action="store_true", help="CPU stand-ins (see the module docstring)")
    a = p.parse_args(argv)
    device = "cpu" if a.smoke else "cuda"
    if a.smoke:
        a.model, a.leak_mb, a.steps = "tiny", 64, 40
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_shared_gpu.py needs an NVIDIA GPU (or --smoke)")
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        held = int(free - a.leave_gb * GB)
    else:
        total, held = 0, 512 * MIB
    if held <= 0:
        raise SystemExit(f"the card has only {free / GB:.1f} GiB free: nothing to hold beside --leave_gb")
    results = {}
    for run in a.runs:
        name = {"a": "a_other_process", "b": "b_outside_allocator", "c": "c_tuning", "d": "d_wall_moves",
                "e": "e_wall_moves_tuning", "f": "f_slow_leak", "g": "g_tenant_returns",
                "h": "h_tenant_returns_tuning"}[run]
        if run in ("g", "h"):
            results[name] = {**returning_tenant_run(name, a, device, tuning=run == "h"), "held_by": "another process"}
        elif run == "f":
            if device == "cuda":                 # all the card's free memory now but --slow_leave_gb
                gc.collect()
                torch.cuda.empty_cache()
                other = OtherProcess(-int(a.slow_leave_gb * GB), device)
                slow_held = torch.cuda.get_device_properties(0).total_memory - torch.cuda.mem_get_info()[0]
            else:
                slow_held = held
                other = OtherProcess(slow_held, device)
            try:
                results[name] = {**one_run(name, a, device, tuning=False, leak_mb=a.slow_leak_mb if device == "cuda"
                                           else 8, steps=a.slow_steps if device == "cuda" else 200),
                                 "held_gb": slow_held / GB, "held_by": "another process"}
            finally:
                other.close()
        elif run in ("d", "e"):
            results[name] = {**moving_wall_run(name, a, device, tuning=run == "e"), "held_by": "another process"}
        elif run == "b":
            release, how = hold_outside_torch(held, device)
            try:
                results[name] = {**one_run(name, a, device, tuning=False), "held_gb": held / GB, "held_by": how}
            finally:
                release()
        else:
            other = OtherProcess(held, device)
            try:
                results[name] = {**one_run(name, a, device, tuning=run == "c"), "held_gb": held / GB,
                                 "held_by": "another process"}
            finally:
                other.close()
        print(f"{name}: {'passed' if results[name]['passed'] else 'FAILED'}", flush=True)
    payload = {"settings": {**vars(a), "device_total_gb": total / GB, "held_gb": held / GB},
               "passed": all(r["passed"] for r in results.values()), "runs": results}
    path = write_result("shared_gpu_smoke" if a.smoke else "shared_gpu", payload)
    print(table(["run", "held by", "held GiB", "budget first/last GiB", "old budget", "stop", "checkpoint", "OOM",
                 "re-sizes", "causes named", "s"],
                [[r["run"], r["held_by"], r.get("held_gb", r.get("taken_gb")),
                  f"{r['budget_per_step'][0]['limit_gb']:.2f}/{r['budget_per_step'][-1]['limit_gb']:.2f}"
                  if r["budget_per_step"] else "-", r.get("old_budget_gb") or "-", r["stop_step"], r["checkpoint"],
                  bool(r["oom"]), r["memory_resizes"],
                  ("leak " if r.get("stop_names_leak") else "") + ("outside" if r["stop_names_outside"] else ""),
                  r["seconds"]] for r in results.values()]))
    print(f"written: {path}")
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
