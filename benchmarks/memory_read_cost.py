"""What one memory reading costs on this machine: each call the watchdog makes a step (psutil, the allocator's
statistics, the driver's free memory), timed over 2,000 calls on an idle device with 2,000 blocks of 1-64 MiB held
(about 64 GiB: a GPU of 80 GB or more). Prints a table; writes ``results/memory_read_cost_<card>.json``."""
import time

import psutil
import torch
from common import table, write_result

from hf_perf_callbacks.platform.device import DeviceLayer, training_device


def per_call(fn, n=2000) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main():
    device = DeviceLayer(training_device())
    d = device.device
    held = [torch.empty(2**20 * (i % 64 + 1), dtype=torch.uint8, device=d) for i in range(2000)]   # many blocks
    calls = {"psutil.virtual_memory": psutil.virtual_memory, "psutil.swap_memory": psutil.swap_memory,
             "DeviceLayer.memory": device.memory, "DeviceLayer.reset_peak": device.reset_peak}
    if torch.cuda.is_available():
        calls.update({"torch.cuda.memory_stats": lambda: torch.cuda.memory_stats(d),
                      "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(d),
                      "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(d)})
    rows = {name: per_call(fn) * 1e3 for name, fn in calls.items()}
    print(table(["call", "ms a call"], [[k, v] for k, v in rows.items()]))
    write_result(f"memory_read_cost_{device.name.split()[-1].lower() if device.type == 'cuda' else 'cpu'}",
                 {"ms_per_call": rows, "blocks_held": len(held)})


if __name__ == "__main__":
    main()
