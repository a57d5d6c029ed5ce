"""The one place that talks to the accelerator: cuda, mps, xpu or cpu.

Every callback goes through :class:`DeviceLayer`; nothing else in the package calls ``torch.cuda`` or
``torch.mps``. It synchronizes, samples memory, clears caches, recognises out-of-memory errors, knows the peak
FLOP/s and bandwidth of the device (table, user override or a short matmul calibration) and exchanges small
vectors between ranks.
"""
from __future__ import annotations

import gc
import logging
import os
import platform
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar, cast

import numpy as np
import psutil
import torch

from ..core.peaks import DevicePeak, dtype_key, lookup_peak
from ..core.runlog import GB
from .macos import MacMemoryReader

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Texts of out-of-memory errors that are not ``torch.OutOfMemoryError`` (MPS, CPU allocator, cuDNN/cuBLAS).
OOM_TEXTS = (
    "out of memory",                       # CUDA, XPU and "MPS backend out of memory"
    "invalid buffer size",                 # MPS: one tensor larger than the device allows
    "defaultcpuallocator: can't allocate memory",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
)


def is_oom_error(error: BaseException) -> bool:
    """True for an out-of-memory error on any device (CUDA ``torch.OutOfMemoryError``, MPS and CPU texts)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(t in str(error).lower() for t in OOM_TEXTS)


def error_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none (a bare ``MemoryError()``)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it was raised from or during, each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


@dataclass(frozen=True)
class MemorySample:
    """Memory at one moment, in bytes; ``None`` where the device does not say."""

    allocated: int | None = None        # live tensors (CUDA/MPS/XPU allocator)
    reserved: int | None = None         # held by the allocator (CUDA reserved; MPS driver memory, cache included)
    peak: int | None = None             # allocator high-water mark since the last reset (CUDA/XPU only)
    device_limit: int | None = None     # what the device can give (CUDA total; MPS recommended working set)
    hard_limit: int | None = None       # MPS: the allocator's hard limit from PYTORCH_MPS_HIGH_WATERMARK_RATIO
    alloc_retries: int | None = None    # CUDA: allocator retries after freeing cache (a thrash signal)
    system_total: int = 0
    system_available: int = 0
    swap_used: int = 0
    rss: int | None = None              # CPU: this process's resident memory (the CPU has no allocator to ask)
    device_free: int | None = None      # CUDA/XPU: what the device can still give (``mem_get_info``'s free bytes)
    allocator_cap: int | None = None    # CUDA: PyTorch's per-process memory fraction × total, when below the total
    unified: bool = False               # the device's memory is the system's (MPS, CPU): what the system can give

    @property
    def used(self) -> int:
        """What counts against a memory budget: the allocator's high-water mark since the last reset (CUDA/XPU),
        driver memory (MPS: unified memory the process holds, cache included), resident memory (CPU)."""
        for value in (self.peak, self.reserved, self.rss, self.allocated):
            if value is not None:
                return value
        return 0

    @property
    def held(self) -> int | None:
        """What this process holds now of the memory ``used`` counts: the allocator's reserved memory (CUDA/XPU; MPS:
        driver memory), resident memory (CPU)."""
        return self.reserved if self.reserved is not None else self.rss

    @property
    def within_reach(self) -> int | None:
        """What this process holds plus what the device can still give it: CUDA/XPU the allocator's reserved memory
        plus the device's free memory (so other processes, a vLLM pool, NCCL buffers, the CUDA context and whatever
        this process holds outside PyTorch's caching allocator are not in it); unified memory (MPS, CPU) what the
        process holds plus the system's available memory. None when the device does not say."""
        held = self.held
        if self.device_free is not None:
            return (self.reserved or 0) + self.device_free
        if self.unified and held is not None:         # the layer reads the system's available memory: 0 is real
            return held + self.system_available
        return None

    @property
    def reachable(self) -> int | None:
        """:attr:`within_reach`, capped by PyTorch's per-process memory fraction (CUDA) where one is set."""
        reach = self.within_reach
        if reach is not None and self.allocator_cap is not None:
            return min(reach, self.allocator_cap)
        return reach

    @property
    def total(self) -> int | None:
        """The memory this run's device has in all: the card's (CUDA/XPU), the machine's RAM (MPS, CPU)."""
        if self.unified:
            return self.system_total or None
        return self.device_limit

    @property
    def outside(self) -> int | None:
        """Memory of :attr:`total` outside this run's reach: held by other processes (CUDA: and by this process
        outside PyTorch's caching allocator: the CUDA context, NCCL buffers, a pool such as vLLM's; MPS/CPU: and by
        the system, and this process's memory that ``used`` does not count). None when the device does not say."""
        reach, total = self.within_reach, self.total
        if reach is None or total is None:
            return None
        return max(0, total - reach)


class DeviceLayer:
    """Accelerator operations for one ``torch.device`` (default: :func:`training_device`)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else training_device()
        if self.device.type in ("cuda", "xpu") and self.device.index is None:   # "cuda": the current one, by index
            self.device = torch.device(self.device.type, getattr(torch, self.device.type).current_device())
        self.type = self.device.type
        self._name: str | None = None
        self.mac = MacMemoryReader()            # the macOS reader: its readers return None off macOS

    # ---------------------------------------------------------------- basics
    def synchronize(self) -> None:
        if self.type in ("cuda", "xpu"):
            getattr(torch, self.type).synchronize(self.device)
        elif self.type == "mps":
            torch.mps.synchronize()

    def empty_cache(self) -> None:
        """Collect Python garbage (tensors held in reference cycles keep their blocks), then give the allocator's
        cached blocks back (MPS: and its graph cache)."""
        gc.collect()
        if self.type in ("cuda", "xpu"):
            getattr(torch, self.type).empty_cache()
        elif self.type == "mps":
            torch.mps.empty_cache()
            clear_graph_cache = getattr(torch.mps, "clear_graph_cache", None)   # not in torch 2.13
            if clear_graph_cache is not None:
                clear_graph_cache()

    def reset_peak(self) -> None:
        if self.type in ("cuda", "xpu"):
            getattr(torch, self.type).reset_peak_memory_stats(self.device)

    def bf16_supported(self) -> bool:
        """Whether bf16 runs natively here (CUDA Ampere+, MPS on macOS 14+, XPU, CPU)."""
        if self.type == "cuda":
            return bool(torch.cuda.is_bf16_supported())
        if self.type == "mps":
            return bool(torch.backends.mps.is_macos_or_newer(14, 0))
        return True

    @property
    def name(self) -> str:
        if self._name is None:
            if self.type in ("cuda", "xpu"):
                self._name = str(getattr(torch, self.type).get_device_name(self.device))
            elif self.type == "mps":
                self._name = self.mac.chip_name() or "Apple Silicon (unknown chip)"
            else:
                self._name = platform.processor() or platform.machine() or "cpu"
        return self._name

    # ---------------------------------------------------------------- memory
    def memory(self) -> MemorySample:
        vm, swap = psutil.virtual_memory(), psutil.swap_memory()
        system = dict(system_total=vm.total, system_available=vm.available, swap_used=swap.used)
        if self.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            free, _ = torch.cuda.mem_get_info(self.device)
            return MemorySample(
                allocated=stats.get("allocated_bytes.all.current", 0),
                reserved=stats.get("reserved_bytes.all.current", 0),
                peak=stats.get("allocated_bytes.all.peak", 0),
                device_limit=total,
                alloc_retries=stats.get("num_alloc_retries", 0),
                device_free=free,
                allocator_cap=self._allocator_cap(total),
                **system,
            )
        if self.type == "mps":
            recommended = torch.mps.recommended_max_memory()
            return MemorySample(
                allocated=torch.mps.current_allocated_memory(),
                reserved=torch.mps.driver_allocated_memory(),
                device_limit=recommended,
                hard_limit=mps_hard_limit(recommended),
                unified=True,
                **system,
            )
        if self.type == "xpu":
            return MemorySample(
                allocated=torch.xpu.memory_allocated(self.device),
                reserved=torch.xpu.memory_reserved(self.device),
                peak=torch.xpu.max_memory_allocated(self.device),
                device_limit=torch.xpu.get_device_properties(self.device).total_memory,
                device_free=torch.xpu.mem_get_info(self.device)[0],
                **system,
            )
        return MemorySample(rss=psutil.Process().memory_info().rss, device_limit=vm.total, unified=True, **system)

    def _allocator_cap(self, total: int) -> int | None:
        """PyTorch's per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``) × ``total``, when
        below the total."""
        fraction = float(torch.cuda.get_per_process_memory_fraction(self.device))
        return int(fraction * total) if 0 < fraction < 1 else None

    def memory_holders(self) -> list[tuple[int, str, int]] | None:
        """The processes holding memory on this CUDA device, as (pid, name, bytes), this process included, read
        through NVML (``pynvml``, from the ``nvidia-ml-py`` package) when it is installed; None when it is not, off
        CUDA, or when NVML cannot say (e.g. a container that hides other processes). Called only when the memory wall
        moves, never per step."""
        if self.type != "cuda":
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            holders = []
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:
                    return None                      # NVML may not say how much (no permission): no guess
                try:
                    name = psutil.Process(proc.pid).name()
                except (psutil.Error, OSError):
                    name = "?"
                holders.append((int(proc.pid), name, int(used)))
            return holders
        except Exception as error:  # noqa: BLE001 - NVML is a nicety for a message; the figures stand without it
            logger.debug("NVML could not list the processes on %s: %s", self.device, error)
            return None

    # ---------------------------------------------------------------- peaks
    def peak(self) -> DevicePeak | None:
        """Table entry for this device (None when unknown: MFU is then omitted, never guessed)."""
        if self.type == "cpu":
            return None
        cores = self.mac.gpu_core_count() if self.type == "mps" else None
        return lookup_peak(self.name, gpu_cores=cores)

    def calibrate_flops(self, dtype: torch.dtype = torch.bfloat16, size: int | None = None, repeats: int = 10) -> float:
        """Achievable dense matmul FLOP/s on this device, measured with a ``size``³ GEMM (warmed up, synchronized).

        ``size`` defaults to 8192 on CUDA (large enough to reach the tensor-core peak), 4096 on MPS/XPU and 1024 on
        the CPU (seconds, not minutes). The operands are drawn on the CPU from a private generator and then moved to
        the device (every backend has CPU generators): the run's RNG streams (and so its sampling and data order)
        are never touched, so they are the same with or without the calibration.
        """
        size = size or {"cuda": 8192, "cpu": 1024}.get(self.type, 4096)
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(size, size, generator=generator).to(self.device, dtype) for _ in range(2))
        for _ in range(2):
            a @ b
        self.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        self.synchronize()
        seconds = time.perf_counter() - start
        return 2.0 * size**3 * repeats / seconds


def mps_hard_limit(recommended: int) -> int | None:
    """The MPS allocator's hard limit: ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` (default 1.7) × recommended working set.

    A ratio of 0 disables the limit (None).
    """
    try:
        ratio = float(os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.7"))
    except ValueError:
        ratio = 1.7
    return int(ratio * recommended) if ratio > 0 else None


def training_device() -> torch.device:
    """The device this process trains on, from the process, never from the model.

    Under FSDP (and DeepSpeed ZeRO-3) the Trainer does not move the model before ``accelerator.prepare``: until then
    its parameters sit on the CPU (or the meta device), so a device read off them is wrong and a tensor placed there
    cannot go over NCCL. In order: accelerate's ``PartialState().device`` once the Trainer's ``Accelerator`` exists
    (it honours ``use_cpu`` and the launcher's ``LOCAL_RANK``); else the ``LOCAL_RANK``-th CUDA/XPU device under a
    launcher; else this process's accelerator as torch sees it (the current CUDA/XPU device, MPS), else the CPU.
    """
    from accelerate.state import PartialState, is_initialized

    if is_initialized():
        return torch.device(PartialState().device)
    local_rank = os.environ.get("LOCAL_RANK", "")
    for kind in ("cuda", "xpu"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            index = int(local_rank) % backend.device_count() if local_rank.isdigit() else backend.current_device()
            return torch.device(kind, index)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# -------------------------------------------------------------------- RNG
#: :func:`rng_state`'s value: Python's state, NumPy's (its legacy form: the array is a uint32 one), torch's CPU
#: generator's, the CUDA generators' (None without CUDA)
RngState: TypeAlias = ("tuple[tuple[Any, ...], dict[str, Any] | tuple[str, Any, int, int, float], torch.Tensor, "
                       "list[torch.Tensor] | None]")


def rng_state() -> RngState:
    """Every RNG stream a training step draws from (Python, NumPy, torch CPU and CUDA)."""
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state: RngState) -> None:
    python, numpy_state, torch_state, cuda_state = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state_all(cuda_state)


# -------------------------------------------------------------------- ranks
def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def rank() -> int:
    """This process's rank (0 on one process)."""
    return torch.distributed.get_rank() if world_size() > 1 else 0


def is_main_process() -> bool:
    return rank() == 0


def gather_floats(values: list[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), in rank order; one collective. Identity on one rank."""
    if world_size() == 1:
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=exchange_device(device))
    gathered = [torch.empty_like(local) for _ in range(world_size())]
    torch.distributed.all_gather(gathered, local)
    return [g.tolist() for g in gathered]


def main_process_value(read: Callable[[], T]) -> T:
    """``read()`` on the main process and its result on every rank (one broadcast), so that ranks act on one reading
    of a shared file that the main process may rewrite meanwhile; ``read()`` itself on one process."""
    if world_size() == 1:
        return read()
    box: list[object] = [read() if is_main_process() else None]
    torch.distributed.broadcast_object_list(box, src=0, device=exchange_device())
    return cast("T", box[0])


def exchange_device(device: torch.device | str | None = None) -> torch.device:
    """Where a tensor for the default process group's collectives must live: the CPU under gloo; otherwise
    ``device`` (default :func:`training_device`), and never the CPU, which NCCL/XCCL cannot carry ("No backend type
    associated with device type cpu") unless the group also has a gloo part (``cuda:nccl,cpu:gloo``)."""
    backend = str(torch.distributed.get_backend()).lower()
    if backend == "gloo":
        return torch.device("cpu")
    chosen = torch.device(device) if device is not None else training_device()
    if chosen.type == "cpu" and "gloo" not in backend:
        chosen = training_device()
    return chosen


__all__ = ["DeviceLayer", "MemorySample", "is_oom_error", "dtype_key", "gather_floats", "main_process_value",
           "exchange_device",
           "training_device", "world_size", "rank", "is_main_process", "rng_state", "set_rng_state", "GB", "error_line",
           "RngState", "error_chain"]
