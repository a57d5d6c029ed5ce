"""The device layer: OOM recognition, memory samples on CPU, and MPS and CUDA paths against fakes.

This machine has no Apple GPU and no NVIDIA GPU, so the MPS tests replace ``torch.mps`` functions with fakes that
follow the documented torch 2.13 API (``current_allocated_memory``, ``driver_allocated_memory``,
``recommended_max_memory``, ``empty_cache``, ``synchronize``; no ``clear_graph_cache``), and the CUDA test replaces
``torch.cuda``'s documented ``memory_stats``, ``get_device_properties``, ``mem_get_info`` and
``get_per_process_memory_fraction``.
"""
import types

import pytest
import torch

from hf_perf_callbacks.platform import device as dev
from hf_perf_callbacks.platform.device import DeviceLayer, gather_floats, is_oom_error, mps_hard_limit


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.80 GB, other allocations: 1.2 GB, max allowed: "
                 "18.13 GB). Tried to allocate 256.00 MB on private pool."),
    RuntimeError("Invalid buffer size: 34.00 GB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
])
def test_out_of_memory_errors_are_recognised(error):
    assert is_oom_error(error)


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch"), ValueError("out of memory"), KeyError("x")])
def test_other_errors_are_not(error):
    assert not is_oom_error(error)


def test_cpu_memory_sample_and_no_peak_table():
    layer = DeviceLayer("cpu")
    sample = layer.memory()
    assert sample.used == sample.rss > 0 and sample.system_total > sample.system_available > 0
    assert sample.allocated is sample.reserved is sample.peak is None      # no allocator figures are made up
    assert layer.peak() is None                  # CPUs have no table entry: MFU is omitted, not guessed
    layer.synchronize()
    layer.empty_cache()
    assert layer.calibrate_flops(torch.float32, size=128, repeats=2) > 1e6


def test_cpu_memory_within_reach_is_what_the_process_holds_plus_what_the_system_can_give():
    sample = DeviceLayer("cpu").memory()
    assert sample.unified and sample.held == sample.rss
    assert sample.reachable == sample.rss + sample.system_available
    assert sample.total == sample.system_total and sample.outside == sample.system_total - sample.reachable >= 0


def test_a_system_with_nothing_left_to_give_leaves_the_run_what_it_holds():
    # seen: an available reading of 0 was taken for "unknown" and the budget jumped back to 85% of the RAM
    sample = dev.MemorySample(reserved=6 * 2**30, system_total=16 * 2**30, system_available=0, unified=True)
    assert sample.reachable == 6 * 2**30 and sample.outside == 10 * 2**30


def test_cuda_memory_within_reach_counts_other_processes_and_memory_outside_the_allocator(monkeypatch):
    """An H200 (139.8 GiB) where another process and a pool outside PyTorch's allocator leave 18.0 GiB free and this
    process's allocator reserves 2.0 GiB: the run can reach 20.0 GiB; a per-process fraction of 0.1 caps it at
    13.98 GiB (the outside memory is still 119.8 GiB: the cap is this process's own)."""
    gib, total = 2**30, int(139.8 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "allocated_bytes.all.current": 1 * gib, "reserved_bytes.all.current": 2 * gib,
        "allocated_bytes.all.peak": int(1.5 * gib), "num_alloc_retries": 0})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        total_memory=total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (18 * gib, total))
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction["value"])
    layer = DeviceLayer("cuda:0")
    sample = layer.memory()
    assert not sample.unified and sample.device_free == 18 * gib and sample.allocator_cap is None
    assert sample.reachable == 20 * gib and sample.total == total and sample.outside == total - 20 * gib
    fraction["value"] = 0.1
    capped = layer.memory()
    assert capped.reachable == int(0.1 * total) and capped.outside == total - 20 * gib
    assert DeviceLayer("cpu").memory_holders() is None                          # NVML is for CUDA only


def test_watermark_ratio(monkeypatch):
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    assert mps_hard_limit(10 * 2**30) == int(1.7 * 10 * 2**30)
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0.8")
    assert mps_hard_limit(10 * 2**30) == int(0.8 * 10 * 2**30)
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0.0")
    assert mps_hard_limit(10 * 2**30) is None    # 0 disables the limit


@pytest.fixture
def fake_mps(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        current_allocated_memory=lambda: 3 * 2**30,
        driver_allocated_memory=lambda: 5 * 2**30,
        recommended_max_memory=lambda: 12 * 2**30,
        empty_cache=lambda: calls.append("empty_cache"),
        synchronize=lambda: calls.append("synchronize"),
    )
    monkeypatch.setattr(torch, "mps", fake)
    return fake, calls


def test_mps_memory_sample_from_the_documented_api(fake_mps, monkeypatch):
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    layer = DeviceLayer("mps")
    sample = layer.memory()
    assert (sample.allocated, sample.reserved, sample.device_limit) == (3 * 2**30, 5 * 2**30, 12 * 2**30)
    assert sample.hard_limit == int(1.7 * 12 * 2**30) and sample.peak is None
    assert sample.unified and sample.reachable == 5 * 2**30 + sample.system_available   # Metal's plus the system's


def test_mps_cache_clear_feature_detects_clear_graph_cache(fake_mps):
    fake, calls = fake_mps
    layer = DeviceLayer("mps")
    layer.empty_cache()
    layer.synchronize()
    assert calls == ["empty_cache", "synchronize"]        # no clear_graph_cache in torch 2.13: skipped
    fake.clear_graph_cache = lambda: calls.append("clear_graph_cache")
    layer.empty_cache()
    assert calls[-2:] == ["empty_cache", "clear_graph_cache"]


def test_mps_peak_needs_the_chip_and_its_gpu_cores(fake_mps):
    layer = DeviceLayer("mps")
    layer.mac = types.SimpleNamespace(chip_name=lambda: "Apple M2 Max", gpu_core_count=lambda: 38)
    peak = layer.peak()
    assert peak.name == "Apple M2 Max (38-core GPU)" and peak.bandwidth == 400e9
    layer = DeviceLayer("mps")
    layer.mac = types.SimpleNamespace(chip_name=lambda: "Apple M2 Max", gpu_core_count=lambda: None)
    assert layer.peak() is None                            # 30 or 38 cores: unknown, so no number


def test_gather_floats_on_one_process_is_identity():
    assert dev.world_size() == 1
    assert gather_floats([1.0, 2.5]) == [[1.0, 2.5]]



def test_a_device_named_without_an_index_is_the_current_one_by_index(monkeypatch):
    """``DeviceLayer("cuda")`` (as a user or a benchmark names it) reads the current device: torch's per-device
    queries such as ``get_per_process_memory_fraction`` refuse a device without an index ("Expected a torch.device
    with a specified index", seen on an H100 with torch 2.11). CUDA is faked: this machine has none."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert DeviceLayer("cuda").device == torch.device("cuda", 3)
    assert DeviceLayer("cuda:1").device == torch.device("cuda", 1)
    assert DeviceLayer("cpu").device == torch.device("cpu")
