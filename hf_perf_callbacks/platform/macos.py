"""macOS memory-pressure readers via ctypes (no root, no subprocess per call).

Trustworthy signals on macOS, cheapest first (each read costs microseconds):

* ``kern.memorystatus_vm_pressure_level`` (sysctl): the kernel's own pressure
  level as dispatch flags, 1 normal, 2 warn, 4 critical; the levels Activity
  Monitor colours green/yellow/red. Any other value is reported as unknown
  (``None``), never as normal.
* ``host_statistics64(HOST_VM_INFO64)``: cumulative VM counters. A growing
  ``swapouts`` between steps means compressed pages are being written to swap
  right now, the definitive "swapping has begun" signal; ``compressor_page_count``
  is the compressor's size (``pageouts`` also counts file-backed dirty pages and
  is less specific). The kernel answers unentitled processes from a cache after
  2-10 calls within one second, so sample at most about once a second for fresh
  counters; deltas stay correct, they just arrive later.
* ``vm.swapusage`` (sysctl): swap files are created on demand and persist, so
  only changes of ``xsu_used`` are meaningful, not its level or a percentage.
* ``proc_pid_rusage(RUSAGE_INFO_V0).ri_phys_footprint``: the figure Activity
  Monitor's "Memory" column and jetsam use; includes compressed pages and
  IOKit/Metal (GPU) memory, unlike RSS.

Not used: psutil's ``virtual_memory().available`` is ``inactive + free`` and
ignores the compressor, so it over-reports headroom while the machine is
already swapping; ``swap_memory().sin/sout`` are ``pageins/pageouts`` times the
page size (every file-backed page-in counts), not swap-ins/outs.

On other platforms, or when libSystem cannot be used, every reader returns
``None``. A reader that fails logs one warning naming the signal and the cause
the first time, then returns ``None`` silently.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

logger = logging.getLogger(__name__)

LIBSYSTEM_PATH = "/usr/lib/libSystem.B.dylib"

_PRESSURE_LEVELS = frozenset((1, 2, 4))     # normal, warn, critical

HOST_VM_INFO64 = 4
HOST_VM_INFO64_COUNT = 38  # sizeof(vm_statistics64) / sizeof(integer_t)
RUSAGE_INFO_V0 = 0
KERN_SUCCESS = 0

natural_t = ctypes.c_uint32


class vm_statistics64(ctypes.Structure):
    """``struct vm_statistics64`` from ``<mach/vm_statistics.h>`` (152 bytes)."""

    _fields_ = [
        ("free_count", natural_t),
        ("active_count", natural_t),
        ("inactive_count", natural_t),
        ("wire_count", natural_t),
        ("zero_fill_count", ctypes.c_uint64),
        ("reactivations", ctypes.c_uint64),
        ("pageins", ctypes.c_uint64),
        ("pageouts", ctypes.c_uint64),
        ("faults", ctypes.c_uint64),
        ("cow_faults", ctypes.c_uint64),
        ("lookups", ctypes.c_uint64),
        ("hits", ctypes.c_uint64),
        ("purges", ctypes.c_uint64),
        ("purgeable_count", natural_t),
        ("speculative_count", natural_t),
        ("decompressions", ctypes.c_uint64),
        ("compressions", ctypes.c_uint64),
        ("swapins", ctypes.c_uint64),
        ("swapouts", ctypes.c_uint64),
        ("compressor_page_count", natural_t),
        ("throttled_count", natural_t),
        ("external_page_count", natural_t),
        ("internal_page_count", natural_t),
        ("total_uncompressed_pages_in_compressor", ctypes.c_uint64),
    ]


class xsw_usage(ctypes.Structure):
    """``struct xsw_usage`` returned by sysctl ``vm.swapusage`` (32 bytes)."""

    _fields_ = [
        ("xsu_total", ctypes.c_uint64),
        ("xsu_avail", ctypes.c_uint64),
        ("xsu_used", ctypes.c_uint64),
        ("xsu_pagesize", ctypes.c_uint32),
        ("xsu_encrypted", ctypes.c_int32),
    ]


class rusage_info_v0(ctypes.Structure):
    """``struct rusage_info_v0`` from ``<sys/resource.h>`` (96 bytes)."""

    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [
        (name, ctypes.c_uint64)
        for name in (
            "ri_user_time",
            "ri_system_time",
            "ri_pkg_idle_wkups",
            "ri_interrupt_wkups",
            "ri_pageins",
            "ri_wired_size",
            "ri_resident_size",
            "ri_phys_footprint",
            "ri_proc_start_abstime",
            "ri_proc_exit_abstime",
        )
    ]


# ctypes prototypes of the libSystem functions used; the real library is bound
# through them, and fakes can wrap Python callables with them.
C_PROTOTYPES: dict[str, Any] = {
    # int sysctlbyname(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen)
    "sysctlbyname": ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_void_p,
        ctypes.c_size_t,
        use_errno=True,
    ),
    # mach_port_t mach_host_self(void)
    "mach_host_self": ctypes.CFUNCTYPE(ctypes.c_uint32),
    # kern_return_t host_statistics64(host_t, host_flavor_t, host_info64_t, mach_msg_type_number_t *)
    "host_statistics64": ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint32),
    ),
    # int proc_pid_rusage(int pid, int flavor, rusage_info_t *buffer)
    "proc_pid_rusage": ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, use_errno=True
    ),
}


class _LibSystem:
    """libSystem with each function bound lazily through ``C_PROTOTYPES``."""

    def __init__(self, path: str = LIBSYSTEM_PATH) -> None:
        self._dll = ctypes.CDLL(path, use_errno=True)

    def __getattr__(self, name: str) -> Any:
        prototype = C_PROTOTYPES.get(name)
        if prototype is None:
            raise AttributeError(name)
        func = prototype((name, self._dll))  # AttributeError if the symbol is missing
        setattr(self, name, func)
        return func


def _default_run(argv: Sequence[str]) -> str:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=2.0, check=True
    ).stdout


def _call_error(func: str, rc: int) -> OSError:
    err = ctypes.get_errno()
    if err:
        return OSError(err, f"{func} returned {rc}: {os.strerror(err)}")
    return OSError(f"{func} returned {rc}")


@dataclass(frozen=True)
class MacMemorySample:
    """Per-step memory readings; every field is ``None`` when unavailable."""

    pressure_level: int | None = None
    swapouts: int | None = None
    compressor_bytes: int | None = None
    swap_used_bytes: int | None = None
    phys_footprint_bytes: int | None = None

    def swapouts_since(self, previous: MacMemorySample) -> int | None:
        """Swap-outs from ``previous`` to this sample (None when either is unknown or the counter went back)."""
        if self.swapouts is None or previous.swapouts is None or self.swapouts < previous.swapouts:
            return None
        return self.swapouts - previous.swapouts


_T = TypeVar("_T")

_GPU_CORES_RE = re.compile(r'"gpu-core-count"\s*=\s*(\d+)')


class MacMemoryReader:
    """Cheap readers of macOS memory signals; construct once, call every step.

    ``lib`` replaces libSystem (any object with ``sysctlbyname``,
    ``host_statistics64``, ``mach_host_self`` and ``proc_pid_rusage`` callables
    taking ctypes ``byref`` pointers); ``run`` replaces the subprocess runner
    used once by :meth:`gpu_core_count` (argv -> stdout, raising on failure).
    Off macOS, without an injected ``lib``, every reader returns None.
    """

    def __init__(self, lib: Any = None, run: Callable[[Sequence[str]], str] | None = None) -> None:
        self._lib_obj = lib
        self._enabled = lib is not None or sys.platform == "darwin"
        self._run = run if run is not None else _default_run
        self._host: int | None = None
        self._warned: set[str] = set()
        self._chip_name: str | None = None
        self._gpu_cores: int | None = None
        self._gpu_cores_done = False

    # -- plumbing -----------------------------------------------------------

    def _lib(self) -> Any:
        if self._lib_obj is None:
            self._lib_obj = _LibSystem()
        return self._lib_obj

    def _read_or_none(self, signal: str, read: Callable[[], _T]) -> _T | None:
        """``read()``, or None when the reader is off or the read fails (one warning per signal)."""
        if not self._enabled:
            return None
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - a reader must never raise
            if signal not in self._warned:
                self._warned.add(signal)
                logger.warning(
                    "macOS memory signal %s unavailable (%s: %s); further failures are not reported",
                    signal,
                    type(exc).__name__,
                    exc,
                )
            return None

    def _sysctl(self, name: str, buf: Any, size: ctypes.c_size_t) -> None:
        """``sysctlbyname(name)`` into ``buf`` (None: only its length, into ``size``); an ``OSError`` on failure."""
        rc = self._lib().sysctlbyname(name.encode(), buf, ctypes.byref(size), None, 0)
        if rc != 0:
            raise _call_error(f"sysctlbyname({name})", rc)

    def _sysctl_into(self, name: str, buf: ctypes.Structure | ctypes.c_uint32) -> None:
        size = ctypes.c_size_t(ctypes.sizeof(buf))
        self._sysctl(name, ctypes.byref(buf), size)
        if size.value != ctypes.sizeof(buf):
            raise ValueError(f"returned {size.value} bytes, expected {ctypes.sizeof(buf)}")

    def _sysctl_string(self, name: str) -> str:
        size = ctypes.c_size_t(0)
        self._sysctl(name, None, size)
        if not 0 < size.value <= 4096:
            raise ValueError(f"unexpected length {size.value}")
        buf = ctypes.create_string_buffer(size.value)
        self._sysctl(name, ctypes.byref(buf), size)
        text = buf.raw[: size.value].split(b"\0", 1)[0].decode("utf-8", "replace").strip()
        if not text:
            raise ValueError("empty string")
        return text

    # -- per-step readers ---------------------------------------------------

    def pressure_level(self) -> int | None:
        """``kern.memorystatus_vm_pressure_level``: 1 normal, 2 warn, 4 critical, else None."""

        def read() -> int:
            value = ctypes.c_uint32()
            self._sysctl_into("kern.memorystatus_vm_pressure_level", value)
            if value.value not in _PRESSURE_LEVELS:
                raise ValueError(f"unknown level {value.value}")
            return value.value

        return self._read_or_none("kern.memorystatus_vm_pressure_level", read)

    def vm_counters(self) -> dict[str, int] | None:
        """``swapouts`` (cumulative) and ``compressor_bytes`` from ``host_statistics64``."""

        def read() -> dict[str, int]:
            lib = self._lib()
            if self._host is None:
                self._host = int(lib.mach_host_self())  # once: each call adds a port right
            stats = vm_statistics64()
            count = ctypes.c_uint32(HOST_VM_INFO64_COUNT)
            rc = lib.host_statistics64(self._host, HOST_VM_INFO64, ctypes.byref(stats), ctypes.byref(count))
            if rc != KERN_SUCCESS:
                raise OSError(f"host_statistics64 returned kern_return_t {rc}")
            if count.value < HOST_VM_INFO64_COUNT:
                raise ValueError(f"count {count.value} < {HOST_VM_INFO64_COUNT}")
            page = os.sysconf("SC_PAGESIZE")
            return {"swapouts": stats.swapouts, "compressor_bytes": stats.compressor_page_count * page}

        return self._read_or_none("host_statistics64(HOST_VM_INFO64)", read)

    def swap_used_bytes(self) -> int | None:
        """``vm.swapusage`` ``xsu_used`` in bytes (compare between steps, not its level)."""

        def read() -> int:
            usage = xsw_usage()
            self._sysctl_into("vm.swapusage", usage)
            return cast(int, usage.xsu_used)            # a ctypes field (typed Any)

        return self._read_or_none("vm.swapusage", read)

    def phys_footprint_bytes(self) -> int | None:
        """``ri_phys_footprint`` of this process."""

        def read() -> int:
            info = rusage_info_v0()
            rc = self._lib().proc_pid_rusage(os.getpid(), RUSAGE_INFO_V0, ctypes.byref(info))
            if rc != 0:
                raise _call_error("proc_pid_rusage", rc)
            return cast(int, info.ri_phys_footprint)

        return self._read_or_none("proc_pid_rusage(RUSAGE_INFO_V0)", read)

    def sample(self) -> MacMemorySample:
        """All per-step readings at once."""
        counters = self.vm_counters() or {}
        return MacMemorySample(
            pressure_level=self.pressure_level(),
            swapouts=counters.get("swapouts"),
            compressor_bytes=counters.get("compressor_bytes"),
            swap_used_bytes=self.swap_used_bytes(),
            phys_footprint_bytes=self.phys_footprint_bytes(),
        )

    # -- static facts (cached) ----------------------------------------------

    def chip_name(self) -> str | None:
        """``machdep.cpu.brand_string``, e.g. ``"Apple M2 Max"``."""
        if self._chip_name is None:
            self._chip_name = self._read_or_none(
                "machdep.cpu.brand_string", lambda: self._sysctl_string("machdep.cpu.brand_string")
            )
        return self._chip_name

    def gpu_core_count(self) -> int | None:
        """GPU core count from one ``ioreg -rc AGXAccelerator -d 1`` call (cached)."""

        def read() -> int:
            output = self._run(["/usr/sbin/ioreg", "-rc", "AGXAccelerator", "-d", "1"])
            match = _GPU_CORES_RE.search(output or "")
            if match is None:
                raise ValueError('no "gpu-core-count" in ioreg output')
            cores = int(match.group(1))
            if cores <= 0:
                raise ValueError(f"gpu-core-count {cores}")
            return cores

        if not self._gpu_cores_done and self._enabled:
            self._gpu_cores_done = True
            self._gpu_cores = self._read_or_none("ioreg gpu-core-count", read)
        return self._gpu_cores
