"""Tests for hf_perf_callbacks.platform.macos.

No Mac is available here: every test runs against a fake libSystem written in
Python from the documented Apple APIs (``sysctlbyname(3)``, Mach
``host_statistics64`` with ``HOST_VM_INFO64``, ``proc_pid_rusage`` with
``RUSAGE_INFO_V0``). The fake functions are wrapped in the module's own ctypes
prototypes, so the real ctypes marshalling (``byref`` -> C pointer) is
exercised; the fakes write raw bytes laid out as in the XNU headers (packed
with ``struct``, independent of the module's Structure definitions).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import struct
import sys
from typing import Any

import pytest

from hf_perf_callbacks.platform import macos
from hf_perf_callbacks.platform.macos import MacMemoryReader, MacMemorySample

LOGGER = "hf_perf_callbacks.platform.macos"
FAKE_HOST_PORT = 0x1503
ENOENT = 2
ENOMEM = 12
ESRCH = 3


def vm_stats_bytes(**values: int) -> bytes:
    """``struct vm_statistics64`` as laid out in <mach/vm_statistics.h>."""
    names_u32a = ["free_count", "active_count", "inactive_count", "wire_count"]
    names_u64a = ["zero_fill_count", "reactivations", "pageins", "pageouts", "faults",
                  "cow_faults", "lookups", "hits", "purges"]
    names_u32b = ["purgeable_count", "speculative_count"]
    names_u64b = ["decompressions", "compressions", "swapins", "swapouts"]
    names_u32c = ["compressor_page_count", "throttled_count", "external_page_count",
                  "internal_page_count"]
    names_u64c = ["total_uncompressed_pages_in_compressor"]
    order = names_u32a + names_u64a + names_u32b + names_u64b + names_u32c + names_u64c
    unknown = set(values) - set(order)
    assert not unknown, unknown
    return struct.pack("<4I9Q2I4Q4IQ", *(values.get(n, 0) for n in order))


def xsw_usage_bytes(total: int, avail: int, used: int, pagesize: int = 16384) -> bytes:
    """``struct xsw_usage`` from <sys/sysctl.h>."""
    return struct.pack("<QQQIi", total, avail, used, pagesize, 1)


def rusage_v0_bytes(phys_footprint: int, resident: int = 0) -> bytes:
    """``struct rusage_info_v0`` from <sys/resource.h>: uuid[16] then ten uint64."""
    raw = bytearray(96)
    struct.pack_into("<Q", raw, 16 + 6 * 8, resident)  # ri_resident_size
    struct.pack_into("<Q", raw, 72, phys_footprint)  # ri_phys_footprint
    return bytes(raw)


class FakeLibSystem:
    """Scripted libSystem whose functions are real ctypes callbacks."""

    def __init__(self) -> None:
        self.sysctls: dict[bytes, bytes] = {
            b"kern.memorystatus_vm_pressure_level": struct.pack("<I", 1),
            b"vm.swapusage": xsw_usage_bytes(2 << 30, 1 << 30, 1 << 30),
            b"machdep.cpu.brand_string": b"Apple M2 Max\0",
        }
        self.vm_stats = vm_stats_bytes()
        self.host_rc = 0
        self.rusage: dict[int, bytes] = {os.getpid(): rusage_v0_bytes(3 << 30)}
        self.mach_host_self_calls = 0
        self.sysctl_calls: list[bytes] = []
        self.rusage_pids: list[int] = []
        protos = macos.C_PROTOTYPES
        self.sysctlbyname = protos["sysctlbyname"](self._sysctlbyname)
        self.mach_host_self = protos["mach_host_self"](self._mach_host_self)
        self.host_statistics64 = protos["host_statistics64"](self._host_statistics64)
        self.proc_pid_rusage = protos["proc_pid_rusage"](self._proc_pid_rusage)

    # int sysctlbyname(const char *, void *oldp, size_t *oldlenp, void *newp, size_t newlen)
    def _sysctlbyname(self, name: bytes, oldp: int | None, oldlenp: Any, newp: int | None,
                      newlen: int) -> int:
        self.sysctl_calls.append(name)
        assert newp is None and newlen == 0  # read-only use
        value = self.sysctls.get(name)
        if value is None:
            ctypes.set_errno(ENOENT)
            return -1
        if not oldp:  # size query
            oldlenp[0] = len(value)
            return 0
        if oldlenp[0] < len(value):
            ctypes.set_errno(ENOMEM)
            return -1
        ctypes.memmove(oldp, value, len(value))
        oldlenp[0] = len(value)
        return 0

    def _mach_host_self(self) -> int:
        self.mach_host_self_calls += 1
        return FAKE_HOST_PORT

    # kern_return_t host_statistics64(host_t, host_flavor_t, host_info64_t, mach_msg_type_number_t *)
    def _host_statistics64(self, host: int, flavor: int, info: int | None, count: Any) -> int:
        if self.host_rc:
            return self.host_rc
        if host != FAKE_HOST_PORT or flavor != 4 or not info or count[0] < 38:
            return 4  # KERN_INVALID_ARGUMENT
        ctypes.memmove(info, self.vm_stats, 152)
        count[0] = 38
        return 0

    # int proc_pid_rusage(int pid, int flavor, rusage_info_t *buffer)
    def _proc_pid_rusage(self, pid: int, flavor: int, buf: int | None) -> int:
        self.rusage_pids.append(pid)
        value = self.rusage.get(pid)
        if flavor != 0 or not buf or value is None:
            ctypes.set_errno(ESRCH)
            return -1
        ctypes.memmove(buf, value, 96)
        return 0

    def set_pressure(self, level: int) -> None:
        self.sysctls[b"kern.memorystatus_vm_pressure_level"] = struct.pack("<I", level)


@pytest.fixture
def fake() -> FakeLibSystem:
    return FakeLibSystem()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def assert_none_twice_warned_once(read, caplog: pytest.LogCaptureFixture, named: str) -> None:
    """``read()`` gives None twice and the reader warns once, naming ``named`` (the failing call)."""
    assert read() is None
    assert read() is None
    records = warnings_of(caplog)
    assert len(records) == 1
    assert named in records[0].getMessage()


def test_struct_layouts() -> None:
    assert ctypes.sizeof(macos.vm_statistics64) == 152
    assert ctypes.sizeof(macos.vm_statistics64) == macos.HOST_VM_INFO64_COUNT * 4
    assert ctypes.sizeof(macos.xsw_usage) == 32
    assert ctypes.sizeof(macos.rusage_info_v0) == 96
    assert macos.rusage_info_v0.ri_phys_footprint.offset == 72
    assert macos.vm_statistics64.swapouts.offset == 120
    assert macos.vm_statistics64.compressor_page_count.offset == 128
    assert macos.xsw_usage.xsu_used.offset == 16


@pytest.mark.parametrize("level", [1, 2, 4])
def test_pressure_level_dispatch_flags(fake: FakeLibSystem, level: int) -> None:
    fake.set_pressure(level)
    assert MacMemoryReader(lib=fake).pressure_level() == level


@pytest.mark.parametrize("level", [0, 3, 8])
def test_pressure_level_unknown_is_none(fake: FakeLibSystem, level: int,
                                        caplog: pytest.LogCaptureFixture) -> None:
    fake.set_pressure(level)
    reader = MacMemoryReader(lib=fake)
    assert_none_twice_warned_once(reader.pressure_level, caplog, "kern.memorystatus_vm_pressure_level")
    fake.set_pressure(2)
    assert reader.pressure_level() == 2


def test_vm_counters_and_compressor_bytes(fake: FakeLibSystem) -> None:
    fake.vm_stats = vm_stats_bytes(swapins=11, swapouts=22, compressions=333,
                                   decompressions=44, pageins=5555, pageouts=66,
                                   compressor_page_count=1000, free_count=7,
                                   total_uncompressed_pages_in_compressor=99)
    counters = MacMemoryReader(lib=fake).vm_counters()
    assert counters == {"swapouts": 22, "compressor_bytes": 1000 * os.sysconf("SC_PAGESIZE")}


def test_mach_host_self_called_once(fake: FakeLibSystem) -> None:
    reader = MacMemoryReader(lib=fake)
    for _ in range(5):
        assert reader.vm_counters() is not None
    assert fake.mach_host_self_calls == 1


def test_host_statistics_failure_is_none(fake: FakeLibSystem,
                                         caplog: pytest.LogCaptureFixture) -> None:
    fake.host_rc = 5  # KERN_FAILURE
    reader = MacMemoryReader(lib=fake)
    assert_none_twice_warned_once(reader.vm_counters, caplog, "host_statistics64")


def test_swapout_growth_between_samples(fake: FakeLibSystem) -> None:
    reader = MacMemoryReader(lib=fake)
    fake.vm_stats = vm_stats_bytes(swapouts=100, swapins=10, compressions=1000,
                                   compressor_page_count=10)
    first = reader.sample()
    fake.vm_stats = vm_stats_bytes(swapouts=164, swapins=10, compressions=1500,
                                   compressor_page_count=20)
    fake.sysctls[b"vm.swapusage"] = xsw_usage_bytes(3 << 30, 1 << 30, (1 << 30) + 4096)
    fake.set_pressure(2)
    second = reader.sample()
    assert isinstance(second, MacMemorySample)
    assert second.pressure_level == 2 and first.pressure_level == 1
    assert second.compressor_bytes == 20 * os.sysconf("SC_PAGESIZE")
    assert second.swap_used_bytes == (1 << 30) + 4096
    assert second.swapouts_since(first) == 64


def test_swapouts_none_when_either_side_missing_or_reset() -> None:
    a = MacMemorySample(swapouts=5)
    b = MacMemorySample(swapouts=None)
    assert b.swapouts_since(a) is None
    assert a.swapouts_since(b) is None
    assert MacMemorySample(swapouts=3).swapouts_since(a) is None    # the counter went back
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.swapouts = 1  # type: ignore[misc]  # frozen


def test_swap_used_bytes(fake: FakeLibSystem) -> None:
    fake.sysctls[b"vm.swapusage"] = xsw_usage_bytes(4 << 30, 1 << 30, 3 << 30)
    assert MacMemoryReader(lib=fake).swap_used_bytes() == 3 << 30


def test_phys_footprint(fake: FakeLibSystem) -> None:
    reader = MacMemoryReader(lib=fake)
    fake.rusage[os.getpid()] = rusage_v0_bytes(phys_footprint=12345678, resident=999)
    assert reader.phys_footprint_bytes() == 12345678
    assert fake.rusage_pids == [os.getpid()]


def test_phys_footprint_failure(fake: FakeLibSystem, caplog: pytest.LogCaptureFixture) -> None:
    reader = MacMemoryReader(lib=fake)
    del fake.rusage[os.getpid()]
    assert reader.phys_footprint_bytes() is None
    assert len(warnings_of(caplog)) == 1
    assert "proc_pid_rusage" in warnings_of(caplog)[0].getMessage()


def test_chip_name_cached(fake: FakeLibSystem) -> None:
    reader = MacMemoryReader(lib=fake)
    assert reader.chip_name() == "Apple M2 Max"
    calls = len(fake.sysctl_calls)
    assert reader.chip_name() == "Apple M2 Max"  # cached
    assert len(fake.sysctl_calls) == calls


def test_missing_sysctl_warns_once(fake: FakeLibSystem,
                                   caplog: pytest.LogCaptureFixture) -> None:
    del fake.sysctls[b"vm.swapusage"]
    reader = MacMemoryReader(lib=fake)
    for _ in range(5):
        assert reader.swap_used_bytes() is None
        assert reader.sample().swap_used_bytes is None
    records = warnings_of(caplog)
    assert len(records) == 1
    assert "vm.swapusage" in records[0].getMessage()
    assert "Errno 2" in records[0].getMessage()  # errno from the fake travels via use_errno
    # other signals unaffected
    assert reader.pressure_level() == 1


def test_wrong_size_sysctl_is_none(fake: FakeLibSystem) -> None:
    fake.sysctls[b"vm.swapusage"] = xsw_usage_bytes(1, 1, 1)[:16]  # 16 bytes instead of 32
    assert MacMemoryReader(lib=fake).swap_used_bytes() is None


class PartialLib:
    """Plain-Python lib with sysctlbyname only (functions absent -> AttributeError)."""

    def __init__(self) -> None:
        self.calls = 0

    def sysctlbyname(self, name: bytes, oldp: Any, oldlenp: Any, newp: Any, newlen: int) -> int:
        # Receives ctypes.byref() objects unconverted; fail like a missing name.
        self.calls += 1
        return -1


def test_lib_missing_functions(caplog: pytest.LogCaptureFixture) -> None:
    lib = PartialLib()
    reader = MacMemoryReader(lib=lib)
    for _ in range(3):
        assert reader.phys_footprint_bytes() is None
        assert reader.vm_counters() is None
        assert reader.pressure_level() is None
    sample = reader.sample()
    assert all(v is None for v in vars(sample).values())
    messages = [r.getMessage() for r in warnings_of(caplog)]
    assert len(messages) == 4  # one per failing signal
    assert any("proc_pid_rusage" in m and "AttributeError" in m for m in messages)
    assert any("host_statistics64" in m and "AttributeError" in m for m in messages)


def test_linux_default_all_none(monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    ran: list[Any] = []
    reader = MacMemoryReader(run=lambda argv: ran.append(argv) or "")
    assert reader.pressure_level() is None
    assert reader.vm_counters() is None
    assert reader.swap_used_bytes() is None
    assert reader.phys_footprint_bytes() is None
    assert reader.chip_name() is None
    assert reader.gpu_core_count() is None
    sample = reader.sample()
    assert all(v is None for v in vars(sample).values())
    assert ran == []
    assert warnings_of(caplog) == []


def test_darwin_loads_lazily_and_degrades(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Real binding path: here the process's libc stands in and lacks the Apple symbols."""
    monkeypatch.setattr(sys, "platform", "darwin")
    loads: list[tuple[Any, ...]] = []
    real_cdll = ctypes.CDLL

    def fake_cdll(path: Any, *args: Any, **kwargs: Any) -> ctypes.CDLL:
        loads.append((path, kwargs))
        return real_cdll(None, **kwargs)

    monkeypatch.setattr(macos.ctypes, "CDLL", fake_cdll)
    reader = MacMemoryReader()
    assert loads == []  # lazy
    assert reader.pressure_level() is None
    assert reader.vm_counters() is None
    assert reader.pressure_level() is None
    assert loads == [("/usr/lib/libSystem.B.dylib", {"use_errno": True})]
    assert len(warnings_of(caplog)) == 2


def test_darwin_load_failure(monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")

    def failing_cdll(*args: Any, **kwargs: Any) -> ctypes.CDLL:
        raise OSError("dlopen failed")

    monkeypatch.setattr(macos.ctypes, "CDLL", failing_cdll)
    reader = MacMemoryReader()
    assert reader.swap_used_bytes() is None
    assert reader.swap_used_bytes() is None
    records = warnings_of(caplog)
    assert len(records) == 1 and "dlopen failed" in records[0].getMessage()


IOREG_OUTPUT = """+-o AGXAcceleratorG14X  <class AGXAcceleratorG14X, id 0x1000003a8, registered>
    {
      "IOClass" = "AGXAcceleratorG14X"
      "gpu-core-count" = 38
      "model" = "Apple M2 Max"
    }
"""


def test_gpu_core_count_parsed_and_cached(fake: FakeLibSystem) -> None:
    calls: list[list[str]] = []

    def run(argv: Any) -> str:
        calls.append(list(argv))
        return IOREG_OUTPUT

    reader = MacMemoryReader(lib=fake, run=run)
    assert reader.gpu_core_count() == 38
    assert reader.gpu_core_count() == 38
    assert len(calls) == 1
    assert calls[0][1:] == ["-rc", "AGXAccelerator", "-d", "1"]


@pytest.mark.parametrize("outcome", ["raise", "no-key", "empty"])
def test_gpu_core_count_failure(fake: FakeLibSystem, outcome: str,
                                caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    def run(argv: Any) -> str:
        nonlocal calls
        calls += 1
        if outcome == "raise":
            raise FileNotFoundError("ioreg")
        return "" if outcome == "empty" else '{ "IOClass" = "AGXAcceleratorG13X" }'

    reader = MacMemoryReader(lib=fake, run=run)
    assert reader.gpu_core_count() is None
    assert reader.gpu_core_count() is None
    assert calls == 1
    assert len(warnings_of(caplog)) == 1
