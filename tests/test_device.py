"""The device layer: OOM recognition, memory samples on CPU, and MPS paths against a fake ``torch.mps``.

This machine has no Apple GPU, so the MPS tests replace ``torch.mps`` functions with fakes that follow the
documented torch 2.13 API (``current_allocated_memory``, ``driver_allocated_memory``, ``recommended_max_memory``,
``empty_cache``, ``synchronize``; no ``clear_graph_cache``).
"""
import types

import pytest
import torch

from hf_perf_callbacks import device as dev
from hf_perf_callbacks.device import DeviceLayer, gather_floats, is_oom_error, mps_hard_limit


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
    layer._mac = types.SimpleNamespace(chip_name=lambda: "Apple M2 Max", gpu_core_count=lambda: 38)
    peak = layer.peak()
    assert peak.name == "Apple M2 Max (38-core GPU)" and peak.bandwidth == 400e9
    layer = DeviceLayer("mps")
    layer._mac = types.SimpleNamespace(chip_name=lambda: "Apple M2 Max", gpu_core_count=lambda: None)
    assert layer.peak() is None                            # 30 or 38 cores: unknown, so no number


def test_gather_floats_on_one_process_is_identity():
    assert dev.world_size() == 1
    assert gather_floats([1.0, 2.5]) == [[1.0, 2.5]]

