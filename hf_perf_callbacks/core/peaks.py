"""Peak dense FLOP/s per dtype and peak memory bandwidth of accelerators, for MFU and decode-bandwidth utilisation.

Conventions:

* FLOP/s are **dense** peaks (no 2:4 sparsity): NVIDIA's "with sparsity" datasheet figures are halved.
* dtype keys: ``"fp32"`` (non-tensor FP32 ALUs), ``"tf32"`` (TF32 tensor cores), ``"bf16"``, ``"fp16"``, ``"fp8"``
  (tensor cores where the device has them). A key is absent where the hardware has no native path (no bf16 on
  T4/V100, nor on Apple M1/M2 where it is emulated; no fp8 before Ada/Hopper; no tf32 before Ampere).
* GeForce tensor cores run at half rate with FP32 accumulation; their figures are the FP32-accumulate ones
  (what PyTorch uses), not the FP16-accumulate headline.
* Bandwidth is the vendor's peak DRAM/HBM (or unified-memory) figure in bytes/s.
* Apple GPUs: 128 FP32 FMA lanes per core = 256 FLOP/clk/core; FP16 runs at the FP32 rate. An entry is a
  per-core rate times the GPU core count, and the core count varies within one chip name, so Apple lookups need
  ``gpu_cores``. Apple published TFLOPS only for M1/M2; M3 and later are estimates (``estimate=True``) from
  third-party clock figures (the upper end is taken, so MFU is not overstated). M5 GPUs add per-core
  "Neural Accelerators" (Apple: ">4x peak GPU AI compute" vs M4); that speculative figure is not used: M5
  fp16/bf16 are the ALU figure, and matmuls on the accelerators can exceed it.
* A name that is unknown or ambiguous (MIG slice, RTX 3080 10 GB vs 12 GB, bare "A100", Apple chip without
  core count) gives None rather than a guess.

Sources:

* NVIDIA datasheets: H100/H100 NVL, H200/H200 NVL, A100 (40/80 GB, SXM4/PCIe), A10, L4, L40, L40S, T4, V100/V100S;
  NVIDIA Hopper architecture whitepaper (H100 SXM5/PCIe dense tables); AWS/NVIDIA A10G datasheet
  (NVIDIA_AWS_A10G_DataSheet, 2022-02-17); Ampere GA102 whitepaper v2 (RTX 3090); Ada Lovelace architecture
  whitepaper v2.1 (RTX 4090, RTX 4080, L4, L40). Cross-checked with Lightning's ``get_available_flops`` table
  (``lightning/fabric/utilities/throughput.py``); this table departs from it for the A10G (it uses A10 figures),
  the H100 NVL (its entry is a two-GPU pair) and GeForce 16-bit (it uses the non-tensor rate).
* Apple: philipturner/metal-benchmarks (M1/M2 clocks and GFLOPS); Apple product pages and announcements (M1/M2
  TFLOPS, GPU core counts, unified-memory bandwidth, M5-family Neural Accelerators) with MacRumors / TechPowerUp
  for the M3 Pro/Max, M3 Ultra and M4 Pro/Max bandwidth; hmc-tech.com, the Sidekick table and powermetrics reports
  for M3/M4 GPU clocks.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .validation import check_number


@dataclass(frozen=True)
class DevicePeak:
    name: str                       # canonical name, e.g. "NVIDIA H100 SXM", "Apple M2 Max (38-core GPU)"
    flops: Mapping[str, float]      # dtype key (as dtype_key gives it) -> dense peak FLOP/s
    bandwidth: float | None         # bytes/s
    estimate: bool = False
    source: str = ""


def _nv(name: str, bandwidth: float, source: str, **flops: float) -> DevicePeak:
    return DevicePeak(name, MappingProxyType(flops), bandwidth, False, source)


_HOPPER_SXM = dict(fp32=66.9e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12, fp8=1978.9e12)
_HOPPER_NVL = dict(fp32=60e12, tf32=417.5e12, bf16=835.5e12, fp16=835.5e12, fp8=1670.5e12)
_A100 = dict(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12)

# (full-match pattern on the normalised runtime name, entry). Normalised: lower case, "-_/(),"
# replaced by spaces, the tokens "nvidia", "geforce" and "tesla" dropped.
_NVIDIA: tuple[tuple[str, DevicePeak], ...] = (
    (r"h200( sxm5?)?( 141gb)?( hbm3e)?",
     _nv("NVIDIA H200 SXM", 4.8e12, "H200 datasheet: same compute as H100 SXM, 141 GB HBM3e", **_HOPPER_SXM)),
    (r"h200 nvl( 141gb)?",
     _nv("NVIDIA H200 NVL", 4.8e12, "H200 datasheet, NVL column (sparse figures halved)", **_HOPPER_NVL)),
    (r"h100( sxm5?)? 80gb hbm3|h100 sxm5?( 80gb)?( hbm3)?",
     _nv("NVIDIA H100 SXM", 3.35e12, "Hopper whitepaper, H100 SXM5 dense", **_HOPPER_SXM)),
    (r"h100( 80gb)? (pcie|hbm2e)( 80gb)?",
     _nv("NVIDIA H100 PCIe", 2.0e12, "Hopper whitepaper, H100 PCIe dense",
         fp32=51.2e12, tf32=378e12, bf16=756e12, fp16=756e12, fp8=1513e12)),
    (r"h100 nvl( 94gb)?",
     _nv("NVIDIA H100 NVL", 3.9e12, "H100 datasheet, NVL column per GPU (sparse figures halved)", **_HOPPER_NVL)),
    (r"a100 sxm4? 80gb|a100 80gb sxm4?",
     _nv("NVIDIA A100 SXM4 80GB", 2039e9, "A100 datasheet (80 GB SXM: 2,039 GB/s)", **_A100)),
    (r"a100 sxm4? 40gb|a100 40gb sxm4?",
     _nv("NVIDIA A100 SXM4 40GB", 1555e9, "A100 datasheet (40 GB: 1,555 GB/s)", **_A100)),
    (r"a100 pcie 80gb|a100 80gb pcie",
     _nv("NVIDIA A100 PCIe 80GB", 1935e9, "A100 datasheet (80 GB PCIe: 1,935 GB/s)", **_A100)),
    (r"a100 pcie 40gb|a100 40gb pcie",
     _nv("NVIDIA A100 PCIe 40GB", 1555e9, "A100 datasheet (40 GB: 1,555 GB/s)", **_A100)),
    (r"a10g",
     _nv("NVIDIA A10G", 600e9, "AWS/NVIDIA A10G datasheet 2022-02-17 (tensor rate below the A10's)",
         fp32=35e12, tf32=35e12, bf16=70e12, fp16=70e12)),
    (r"a10",
     _nv("NVIDIA A10", 600e9, "A10 datasheet", fp32=31.2e12, tf32=62.5e12, bf16=125e12, fp16=125e12)),
    (r"l4",
     _nv("NVIDIA L4", 300e9, "L4 datasheet (sparse figures halved)",
         fp32=30.3e12, tf32=60e12, bf16=121e12, fp16=121e12, fp8=242.5e12)),
    (r"l40s",
     _nv("NVIDIA L40S", 864e9, "L40S datasheet (sparse figures halved)",
         fp32=91.6e12, tf32=183e12, bf16=362.05e12, fp16=362.05e12, fp8=733e12)),
    (r"l40",
     _nv("NVIDIA L40", 864e9, "L40 datasheet (sparse figures halved)",
         fp32=90.5e12, tf32=90.5e12, bf16=181.05e12, fp16=181.05e12, fp8=362e12)),
    (r"t4",
     _nv("NVIDIA T4", 320e9, "T4 datasheet (FP16/FP32 mixed-precision tensor)", fp32=8.1e12, fp16=65e12)),
    (r"v100 sxm2( (16|32)gb)?",
     _nv("NVIDIA V100 SXM2", 900e9, "V100 datasheet (SXM2)", fp32=15.7e12, fp16=125e12)),
    (r"v100 pcie( (16|32)gb)?",
     _nv("NVIDIA V100 PCIe", 900e9, "V100 datasheet (PCIe)", fp32=14e12, fp16=112e12)),
    (r"v100s pcie( 32gb)?",
     _nv("NVIDIA V100S PCIe", 1134e9, "V100S datasheet", fp32=16.4e12, fp16=130e12)),
    (r"rtx 4090",
     _nv("NVIDIA GeForce RTX 4090", 1008e9, "Ada whitepaper v2.1, FP32-accumulate tensor rates",
         fp32=82.6e12, tf32=82.6e12, bf16=165.2e12, fp16=165.2e12, fp8=330.3e12)),
    (r"rtx 4080",
     _nv("NVIDIA GeForce RTX 4080", 716.8e9, "Ada whitepaper v2.1, FP32-accumulate tensor rates",
         fp32=48.7e12, tf32=48.7e12, bf16=97.5e12, fp16=97.5e12, fp8=194.9e12)),
    (r"rtx 3090",
     _nv("NVIDIA GeForce RTX 3090", 936e9, "GA102 whitepaper v2, FP32-accumulate tensor rates",
         fp32=35.6e12, tf32=35.6e12, bf16=71e12, fp16=71e12)),
)

_M12 = "256 FLOP/clk/core x clock (philipturner/metal-benchmarks); fp16 = fp32 rate; bf16 emulated, omitted"
_M3 = ("estimate: 256 FLOP/clk/core x ~1.6 GHz (published estimates 1.40-1.60 GHz, hmc-tech.com, Sidekick); "
       "fp16 = bf16 = fp32 rate")
_M4 = ("estimate: 256 FLOP/clk/core x ~1.8 GHz (published estimates 1.47-1.80 GHz, hmc-tech.com, Sidekick, "
       "powermetrics 1.58 GHz on M4 Pro); fp16 = bf16 = fp32 rate")
_M5 = ("estimate: GPU ALU rate, 256 FLOP/clk/core x ~1.76 GHz (published 10-core estimates 4-4.5 TFLOPS); "
       "fp16/bf16 omitted: their matmuls use the Neural Accelerators (Apple: '>4x AI compute'; about 7.6 TFLOPS "
       "bf16 measured on a 10-core M5), for which no reliable peak exists; use peak_flops='calibrate'")

# chip -> (FP32 FLOP/s per GPU core, {GPU cores: bandwidth bytes/s}, estimate, has native bf16, source)
_APPLE: dict[str, tuple[float, dict[int, float], bool, bool, str]] = {
    "M1": (256 * 1.278e9, {7: 68.25e9, 8: 68.25e9}, False, False, _M12 + " (Apple: 2.6 TFLOPS)"),
    "M1 Pro": (256 * 1.296e9, {14: 200e9, 16: 200e9}, False, False, _M12 + " (Apple: 5.2 TFLOPS)"),
    "M1 Max": (256 * 1.296e9, {24: 400e9, 32: 400e9}, False, False, _M12 + " (Apple: 10.4 TFLOPS)"),
    "M1 Ultra": (256 * 1.296e9, {48: 800e9, 64: 800e9}, False, False, _M12 + " (Apple: 21 TFLOPS)"),
    "M2": (256 * 1.398e9, {8: 100e9, 10: 100e9}, False, False, _M12 + " (Apple: 3.6 TFLOPS)"),
    "M2 Pro": (256 * 1.398e9, {16: 200e9, 19: 200e9}, False, False, _M12 + " (Apple: 6.8 TFLOPS)"),
    "M2 Max": (256 * 1.398e9, {30: 400e9, 38: 400e9}, False, False, _M12 + " (Apple: 13.6 TFLOPS)"),
    "M2 Ultra": (256 * 1.398e9, {60: 800e9, 76: 800e9}, False, False, _M12 + " (Apple: 27.2 TFLOPS)"),
    "M3": (256 * 1.6e9, {8: 100e9, 10: 100e9}, True, True, _M3),
    "M3 Pro": (256 * 1.6e9, {14: 150e9, 18: 150e9}, True, True, _M3),
    "M3 Max": (256 * 1.6e9, {30: 300e9, 40: 400e9}, True, True, _M3),
    "M3 Ultra": (256 * 1.6e9, {60: 819e9, 80: 819e9}, True, True, _M3),
    "M4": (256 * 1.8e9, {8: 120e9, 10: 120e9}, True, True, _M4),
    "M4 Pro": (256 * 1.8e9, {16: 273e9, 20: 273e9}, True, True, _M4),
    "M4 Max": (256 * 1.8e9, {32: 410e9, 40: 546e9}, True, True, _M4),
    "M5": (256 * 1.76e9, {8: 153e9, 10: 153e9}, True, True, _M5),
    "M5 Pro": (256 * 1.76e9, {20: 307e9}, True, True, _M5),
    "M5 Max": (256 * 1.76e9, {40: 614e9}, True, True, _M5),
}

_APPLE_RE = re.compile(r"(?:apple )?(m[1-9])(?: (pro|max|ultra))?(?: (\d+) core gpu)?")
_DROP = {"nvidia", "geforce", "tesla"}


def _apple(chip: str, cores: int | None) -> DevicePeak | None:
    if chip not in _APPLE or cores is None:
        return None  # every Apple chip name ships with several GPU core counts
    per_core, variants, estimate, bf16, source = _APPLE[chip]
    if cores not in variants:
        return None
    rate = per_core * cores
    if chip.startswith("M5"):   # half-precision matmuls run on the Neural Accelerators: no trustworthy figure
        flops = dict(fp32=rate)
    else:
        flops = dict(fp32=rate, fp16=rate, **({"bf16": rate} if bf16 else {}))
    return DevicePeak(f"Apple {chip} ({cores}-core GPU)", MappingProxyType(flops), variants[cores], estimate, source)


def lookup_peak(device_name: str, gpu_cores: int | None = None) -> DevicePeak | None:
    """Peak entry for a runtime device name (``torch.cuda.get_device_name()``, Apple ``machdep.cpu.brand_string``).

    ``gpu_cores`` is needed for Apple chips (the core count varies within a chip name); it is ignored otherwise.
    Unknown or ambiguous names give None.
    """
    check_number("gpu_cores", gpu_cores, low=1, integer=True, allow_none=True)
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {device_name!r}")
    name = " ".join(t for t in re.sub(r"[-_/(),]", " ", device_name.lower()).split() if t not in _DROP)
    for pattern, peak in _NVIDIA:
        if re.fullmatch(pattern, name):
            return peak
    match = _APPLE_RE.fullmatch(name)
    if match is None:
        return None
    chip = " ".join(filter(None, (match.group(1).upper(), (match.group(2) or "").capitalize())))
    named = int(match.group(3)) if match.group(3) else None
    if named is not None and gpu_cores is not None and named != gpu_cores:
        return None  # name and core count disagree
    return _apple(chip, gpu_cores if gpu_cores is not None else named)


_DTYPE_KEYS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def dtype_key(dtype: object) -> str:
    """Table key for a torch dtype or a dtype string: torch.bfloat16 / "bfloat16" / "bf16" -> "bf16", etc."""
    is_torch = type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"
    text = dtype.strip().lower() if isinstance(dtype, str) else str(dtype) if is_torch else ""
    key = _DTYPE_KEYS.get(text.removeprefix("torch."))
    if key is None:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_KEYS)} or a torch dtype")
    return key


__all__ = ["DevicePeak", "lookup_peak", "dtype_key"]
