"""Give back the memory a failed or finished step holds, before a save, a resume or a retry (one job, shared by the
executor and the exactness check)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from ..platform import adapter
from ..platform.device import DeviceLayer, training_device

if TYPE_CHECKING:
    from transformers import Trainer


def free_memory(trainer: Trainer, warn_once: Callable[[str, str], object]) -> None:
    """Drop the gradients and give the device's cached memory back (after an OOM, before a save or a resume; FSDP2:
    its iteration state reset on this rank first, the gathered parameters freed). A failing cache clear is one
    warning (``warn_once(key, message)``), never the end of the run."""
    model = cast(torch.nn.Module, trainer.model)             # None only before the trainer's init
    adapter.reset_fsdp_iteration(model)
    model.zero_grad(set_to_none=True)
    try:
        DeviceLayer(training_device()).empty_cache()
    except Exception as error:  # noqa: BLE001 - housekeeping: going on without it
        warn_once("emptying the device cache", f"emptying the device cache failed during recovery "
                                               f"({type(error).__name__}: {error}); going on without it")
