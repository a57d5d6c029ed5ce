"""Tests for hf_perf_callbacks.core.peaks: runtime-name lookup, spot-checked figures, near misses, dtype keys."""

from __future__ import annotations

import pytest
import torch

from hf_perf_callbacks.core import peaks
from hf_perf_callbacks.core.peaks import DevicePeak, dtype_key, lookup_peak

# runtime string -> canonical entry name
CUDA_NAMES = {
    "NVIDIA H200": "NVIDIA H200 SXM",
    "NVIDIA H200 NVL": "NVIDIA H200 NVL",
    "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM",
    "NVIDIA H100 PCIe": "NVIDIA H100 PCIe",
    "NVIDIA H100 80GB HBM2e": "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL": "NVIDIA H100 NVL",
    "NVIDIA A100-SXM4-80GB": "NVIDIA A100 SXM4 80GB",
    "NVIDIA A100-SXM-80GB": "NVIDIA A100 SXM4 80GB",
    "NVIDIA A100-SXM4-40GB": "NVIDIA A100 SXM4 40GB",
    "NVIDIA A100-PCIE-40GB": "NVIDIA A100 PCIe 40GB",
    "NVIDIA A100 80GB PCIe": "NVIDIA A100 PCIe 80GB",
    "NVIDIA A10G": "NVIDIA A10G",
    "NVIDIA A10": "NVIDIA A10",
    "NVIDIA L4": "NVIDIA L4",
    "NVIDIA L40S": "NVIDIA L40S",
    "NVIDIA L40": "NVIDIA L40",
    "Tesla T4": "NVIDIA T4",
    "Tesla V100-SXM2-16GB": "NVIDIA V100 SXM2",
    "Tesla V100-SXM2-32GB": "NVIDIA V100 SXM2",
    "Tesla V100-PCIE-32GB": "NVIDIA V100 PCIe",
    "Tesla V100S-PCIE-32GB": "NVIDIA V100S PCIe",
    "NVIDIA GeForce RTX 4090": "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 4080": "NVIDIA GeForce RTX 4080",
    "NVIDIA GeForce RTX 3090": "NVIDIA GeForce RTX 3090",
}


def approx(value: float, rel: float = 0.01):
    return pytest.approx(value, rel=rel)


@pytest.mark.parametrize("runtime, canonical", CUDA_NAMES.items())
def test_cuda_runtime_names_resolve(runtime, canonical):
    peak = lookup_peak(runtime)
    assert isinstance(peak, DevicePeak)
    assert peak.name == canonical
    assert not peak.estimate and peak.source
    # case, spacing and punctuation do not matter
    assert lookup_peak(f"  {runtime.upper()}  ") is peak
    assert lookup_peak(runtime.lower().replace(" ", "  ")) is peak


def test_spot_checked_figures():
    h100 = lookup_peak("NVIDIA H100 80GB HBM3")
    assert h100.flops["bf16"] == approx(989.4e12)
    assert h100.flops["fp16"] == approx(989.4e12)
    assert h100.flops["tf32"] == approx(494.7e12)
    assert h100.flops["fp8"] == approx(1978.9e12)
    assert h100.flops["fp32"] == approx(66.9e12)
    assert h100.bandwidth == approx(3.35e12)

    h200 = lookup_peak("NVIDIA H200")
    assert h200.flops == h100.flops and h200.bandwidth == approx(4.8e12)
    assert lookup_peak("NVIDIA H200 NVL").flops["bf16"] == approx(835.5e12)

    pcie = lookup_peak("NVIDIA H100 PCIe")
    assert pcie.flops["bf16"] == approx(756e12) and pcie.bandwidth == approx(2.0e12)
    nvl = lookup_peak("NVIDIA H100 NVL")
    assert nvl.flops["bf16"] == approx(835.5e12) and nvl.bandwidth == approx(3.9e12)

    bandwidths = {
        "NVIDIA A100-SXM4-80GB": 2039e9,
        "NVIDIA A100-SXM4-40GB": 1555e9,
        "NVIDIA A100-PCIE-40GB": 1555e9,
        "NVIDIA A100 80GB PCIe": 1935e9,
    }
    for runtime, bandwidth in bandwidths.items():
        a100 = lookup_peak(runtime)
        assert a100.flops["bf16"] == approx(312e12)
        assert a100.flops["tf32"] == approx(156e12)
        assert a100.flops["fp32"] == approx(19.5e12)
        assert "fp8" not in a100.flops
        assert a100.bandwidth == approx(bandwidth)

    assert lookup_peak("NVIDIA A10").flops["bf16"] == approx(125e12)
    assert lookup_peak("NVIDIA A10G").flops["bf16"] == approx(70e12)
    assert lookup_peak("NVIDIA A10G").bandwidth == lookup_peak("NVIDIA A10").bandwidth == approx(600e9)
    assert lookup_peak("NVIDIA L4").flops["bf16"] == approx(121e12)
    assert lookup_peak("NVIDIA L4").bandwidth == approx(300e9)
    assert lookup_peak("NVIDIA L40S").flops["bf16"] == approx(362e12)
    assert lookup_peak("NVIDIA L40S").flops["fp8"] == approx(733e12)
    assert lookup_peak("NVIDIA L40").flops["bf16"] == approx(181e12)
    assert lookup_peak("NVIDIA GeForce RTX 4090").flops["bf16"] == approx(165.2e12)
    assert lookup_peak("NVIDIA GeForce RTX 4090").bandwidth == approx(1008e9)
    assert lookup_peak("NVIDIA GeForce RTX 3090").flops["fp16"] == approx(71e12)
    assert lookup_peak("NVIDIA GeForce RTX 3090").bandwidth == approx(936e9)

    t4 = lookup_peak("Tesla T4")
    assert t4.flops == {"fp32": approx(8.1e12), "fp16": approx(65e12)}
    assert t4.bandwidth == approx(320e9)
    v100 = lookup_peak("Tesla V100-SXM2-16GB")
    assert "bf16" not in v100.flops and "tf32" not in v100.flops
    assert v100.flops["fp16"] == approx(125e12) and v100.bandwidth == approx(900e9)


@pytest.mark.parametrize("a, b", [
    ("NVIDIA L40", "NVIDIA L40S"),
    ("NVIDIA L4", "NVIDIA L40"),
    ("NVIDIA A10", "NVIDIA A10G"),
    ("NVIDIA A10", "NVIDIA A100-SXM4-40GB"),
    ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H100 NVL", "NVIDIA H100 PCIe"),
    ("NVIDIA H200", "NVIDIA H200 NVL"),
    ("NVIDIA H200", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"),
    ("Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4080"),
])
def test_near_misses_do_not_collide(a, b):
    assert lookup_peak(a).name != lookup_peak(b).name


@pytest.mark.parametrize("name", [
    "NVIDIA GeForce GTX 1080",
    "Intel Arc",
    "Intel(R) Arc(TM) A770 Graphics",
    "NVIDIA GH200 480GB",                  # not an H200
    "NVIDIA H100",                         # form factor unknown
    "NVIDIA H100 64GB HBM3",               # other SXM memory variant
    "NVIDIA A100",                         # bandwidth differs by variant
    "NVIDIA A100-SXM4",
    "NVIDIA A800-SXM4-80GB",
    "NVIDIA A40",
    "NVIDIA L20",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA GeForce RTX 4090 Laptop GPU",
    "NVIDIA GeForce RTX 4080 SUPER",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 3080",             # 10 GB and 12 GB report the same name
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
    "Tesla P100-PCIE-16GB",
    "Apple M6",
    "Apple A17 Pro",
    "",
    "   ",
])
def test_unknown_names_give_none(name):
    assert lookup_peak(name) is None
    assert lookup_peak(name, gpu_cores=10) is None


@pytest.mark.parametrize("name", [
    "Apple M1", "Apple M1 Pro", "Apple M1 Max", "Apple M1 Ultra",
    "Apple M2", "Apple M2 Pro", "Apple M2 Max", "Apple M2 Ultra",
    "Apple M3", "Apple M3 Pro", "Apple M3 Max", "Apple M3 Ultra",
    "Apple M4", "Apple M4 Pro", "Apple M4 Max",
    "Apple M5", "Apple M5 Pro", "Apple M5 Max",
])
def test_apple_without_cores_is_none(name):
    assert lookup_peak(name) is None


def test_apple_per_core_times_cores():
    m1max = lookup_peak("Apple M1 Max", gpu_cores=32)
    assert m1max.name == "Apple M1 Max (32-core GPU)"
    assert 10.4e12 <= m1max.flops["fp32"] <= 10.65e12
    assert m1max.flops["fp16"] == m1max.flops["fp32"]
    assert "bf16" not in m1max.flops  # emulated on M1/M2
    assert m1max.bandwidth == approx(400e9)
    assert not m1max.estimate

    m1max24 = lookup_peak("Apple M1 Max", gpu_cores=24)
    assert m1max24.flops["fp32"] == approx(m1max.flops["fp32"] * 24 / 32, rel=1e-9)

    assert lookup_peak("Apple M1", gpu_cores=8).flops["fp32"] == approx(2.6e12)
    assert lookup_peak("Apple M1", gpu_cores=8).bandwidth == approx(68.25e9)
    assert lookup_peak("Apple M1 Pro", gpu_cores=16).flops["fp32"] == approx(5.3e12)
    assert lookup_peak("Apple M2", gpu_cores=10).flops["fp32"] == approx(3.6e12)
    assert lookup_peak("Apple M2 Max", gpu_cores=38).flops["fp32"] == approx(13.6e12)
    m2ultra = lookup_peak("Apple M2 Ultra", gpu_cores=76)
    assert m2ultra.flops["fp32"] == approx(27.2e12)
    assert m2ultra.bandwidth == approx(800e9)


def test_apple_bandwidth_per_variant_and_estimates():
    m3max30 = lookup_peak("Apple M3 Max", gpu_cores=30)
    m3max40 = lookup_peak("Apple M3 Max", gpu_cores=40)
    assert m3max30.bandwidth == approx(300e9) and m3max40.bandwidth == approx(400e9)
    assert m3max40.flops["fp32"] == approx(m3max30.flops["fp32"] * 40 / 30, rel=1e-9)
    assert m3max40.estimate and m3max40.source
    assert m3max40.flops["bf16"] == m3max40.flops["fp16"] == m3max40.flops["fp32"]
    assert 14e12 <= m3max40.flops["fp32"] <= 16.5e12

    m4max32 = lookup_peak("Apple M4 Max", gpu_cores=32)
    m4max40 = lookup_peak("Apple M4 Max", gpu_cores=40)
    assert m4max32.bandwidth == approx(410e9) and m4max40.bandwidth == approx(546e9)
    assert 17e12 <= m4max40.flops["fp32"] <= 18.5e12
    assert lookup_peak("Apple M4 Pro", gpu_cores=20).bandwidth == approx(273e9)
    assert lookup_peak("Apple M3 Ultra", gpu_cores=80).bandwidth == approx(819e9)

    m5 = lookup_peak("Apple M5", gpu_cores=10)
    assert m5.estimate and m5.bandwidth == approx(153e9)
    assert 4e12 <= m5.flops["fp32"] <= 4.6e12
    assert set(m5.flops) == {"fp32"}   # half-precision matmuls use the Neural Accelerators: no peak, no MFU
    assert "Neural Accelerator" in m5.source
    assert lookup_peak("Apple M5 Max", gpu_cores=40).bandwidth == approx(614e9)
    assert lookup_peak("Apple M5 Pro", gpu_cores=20).bandwidth == approx(307e9)


def test_apple_name_matching():
    assert lookup_peak("Apple M1", gpu_cores=8).name == "Apple M1 (8-core GPU)"
    assert lookup_peak("apple m1 max", gpu_cores=32).name == "Apple M1 Max (32-core GPU)"
    assert lookup_peak("Apple M1", gpu_cores=32) is None       # M1 has no 32-core variant
    assert lookup_peak("Apple M1 Max", gpu_cores=8) is None    # M1 Max has no 8-core variant
    assert lookup_peak("Apple M3 Max", gpu_cores=36) is None   # unknown variant: no guess
    # canonical names round-trip, with the core count taken from the name
    peak = lookup_peak("Apple M2 Max (38-core GPU)")
    assert peak is not None and peak.name == "Apple M2 Max (38-core GPU)"
    assert lookup_peak("Apple M2 Max (38-core GPU)", gpu_cores=38) == peak
    assert lookup_peak("Apple M2 Max (38-core GPU)", gpu_cores=30) is None  # contradiction


def test_canonical_names_round_trip_and_table_sanity():
    entries = [peak for _, peak in peaks._NVIDIA]
    for chip, (_, variants, *_rest) in peaks._APPLE.items():
        entries += [lookup_peak(f"Apple {chip}", gpu_cores=cores) for cores in variants]
    assert len({e.name for e in entries}) == len(entries)
    for entry in entries:
        assert lookup_peak(entry.name) == entry
        assert entry.flops and all(dtype_key(key) == key for key in entry.flops)     # the table's own keys
        assert all(1e12 <= value <= 3e15 for value in entry.flops.values()), entry.name
        assert 50e9 <= entry.bandwidth <= 6e12, entry.name
        assert entry.source
        assert entry.flops.get("fp16", entry.flops["fp32"]) >= entry.flops["fp32"]
        if "bf16" in entry.flops:
            assert entry.flops["bf16"] == entry.flops["fp16"]
        with pytest.raises(TypeError):
            entry.flops["fp32"] = 1.0  # table entries are read-only


@pytest.mark.parametrize("bad", [0, -8, 1.5, 10.0, "10", True, False, [10]])
def test_gpu_cores_validation(bad):
    with pytest.raises(ValueError, match="gpu_cores") as info:
        lookup_peak("Apple M1", gpu_cores=bad)
    assert repr(bad) in str(info.value)


def test_gpu_cores_ignored_for_nvidia():
    assert lookup_peak("NVIDIA L4", gpu_cores=58) is lookup_peak("NVIDIA L4")


@pytest.mark.parametrize("value, key", [
    (torch.float32, "fp32"),
    (torch.bfloat16, "bf16"),
    (torch.float16, "fp16"),
    (torch.half, "fp16"),
    (torch.float8_e4m3fn, "fp8"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"),
    ("fp32", "fp32"), ("float32", "fp32"),
    ("tf32", "tf32"),
    ("torch.bfloat16", "bf16"),
    (" fp8 ", "fp8"),
])
def test_dtype_key(value, key):
    assert dtype_key(value) == key


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "int8", "fp64", "", None, 16])
def test_dtype_key_rejects(bad):
    with pytest.raises(ValueError) as info:
        dtype_key(bad)
    assert repr(bad) in str(info.value)


def test_mfu_use_with_dtype_key():
    peak = lookup_peak("NVIDIA H100 80GB HBM3")
    assert peak.flops[dtype_key(torch.bfloat16)] == approx(989.4e12)
    assert lookup_peak("Tesla T4").flops.get(dtype_key(torch.bfloat16)) is None
