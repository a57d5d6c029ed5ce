"""DataLoader advice for a device that waits for data: the settings to change, relative to the run's own. Pure (no
torch); shared by the meter's warning and the analysis' ``input_bound`` finding, so both give the same advice."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast


class DataLoaderFacts(TypedDict, total=False):
    """The run's DataLoader settings (the training arguments' ``dataloader_*``; a key the run header lacks is
    absent)."""

    num_workers: int | None
    persistent_workers: bool | None
    prefetch_factor: int | None
    pin_memory: bool | None


#: each fact's type: the training arguments' ``dataloader_<key>``
FACT_TYPES: dict[str, type] = {"num_workers": int, "persistent_workers": bool, "prefetch_factor": int,
                               "pin_memory": bool}


def dataloader_facts(settings: Mapping[str, Any] | None) -> DataLoaderFacts:
    """The DataLoader facts of a mapping (the run header's ``dataloader``): each known key whose value is None or
    of its type (a bool is no count of workers); others are left out."""
    given = settings or {}
    facts = {key: given[key] for key, kind in FACT_TYPES.items() if key in given and (
        given[key] is None or (isinstance(given[key], kind) and (kind is bool or not isinstance(given[key], bool))))}
    return cast(DataLoaderFacts, facts)


def dataloader_changes(device_type: str, dataloader: DataLoaderFacts | None) -> list[tuple[str, dict[str, bool | int]]]:
    """The DataLoader settings to change when the device waits for data, as (advice line, the config keys it sets)
    (the meter's warning, the finding's setting): ``dataloader`` holds the run's ``num_workers``,
    ``persistent_workers``, ``prefetch_factor`` and ``pin_memory``. Settings already in effect are not repeated."""
    dl: DataLoaderFacts = dataloader or {}
    workers = dl.get("num_workers") or 0
    target = {"cuda": 4, "xpu": 4}.get(device_type, 2)
    if workers >= target:
        target = 2 * workers
    first = f"`dataloader_num_workers: {target}` (now {workers})"
    if device_type == "mps":
        first += (" (transformers starts more than one worker with fork on MPS; if workers hang, set "
                  "`dataloader_multiprocessing_context: spawn`, which needs a picklable dataset and collator)")
    elif device_type != "cuda":
        first += " (workers share the CPU cores with training: they hide waiting, not computing)"
    out: list[tuple[str, dict[str, bool | int]]] = [(first, {"dataloader_num_workers": target})]
    if dl.get("persistent_workers") is not True:
        out.append(("`dataloader_persistent_workers: true` (workers survive epochs instead of restarting)",
                    {"dataloader_persistent_workers": True}))
    prefetch = dl.get("prefetch_factor")
    if prefetch is not None and prefetch < 2:     # None: torch's default, 2
        out.append(("`dataloader_prefetch_factor: 2` (batches each worker prepares ahead)",
                    {"dataloader_prefetch_factor": 2}))
    if device_type == "cuda" and dl.get("pin_memory") is not True:
        out.append(("`dataloader_pin_memory: true` (page-locked host memory: faster, asynchronous copies)",
                    {"dataloader_pin_memory": True}))
    elif device_type == "mps" and dl.get("pin_memory") is not False:
        out.append(("`dataloader_pin_memory: false` (unified memory: nothing to pin)",
                    {"dataloader_pin_memory": False}))
    out.append(("pre-tokenize once (`dataset.map(tokenize, batched=True)` before building the trainer) so the "
                "per-step work is only collation", {}))
    return out
