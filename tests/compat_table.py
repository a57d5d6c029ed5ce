"""The README's compatibility table, rendered from the matrix's recorded results (``tests/compat_results.json``,
written by the matrix's tests through :func:`tests.compat.record`), never written by hand.

``python -m tests.compat_table`` writes it into ``README.md`` between :data:`BEGIN` and :data:`END`;
``tests/test_compat_matrix.py`` fails while the README's table differs from what the recorded results render.
"""
from __future__ import annotations

import os
import sys
import textwrap

from tests.compat import (
    BATCH,
    COLUMNS,
    NOT_MEASURED,
    RESIZE_FAULT_AT,
    RESIZE_PER_EPOCH,
    RESIZE_STEPS,
    SETTINGS,
    STEPS,
    TRAINERS,
    Cell,
    load_results,
    pinned_versions,
)

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN = "<!-- compat-table: rendered by `python -m tests.compat_table` from tests/compat_results.json -->"
END = "<!-- compat-table: end -->"
MARKS = {"yes": "✓", "no": "✗", "refused": "refused"}


def render(results: dict) -> str:
    """The table (markdown) with its legend and the messages of refused and failed cells as numbered notes."""
    columns = " · ".join(COLUMNS.values())
    legend = (f"Each cell: {columns}. ✓ the tests showed it, ✗ they showed it does not hold (why in the note), "
              f"refused: the trainer refuses the setting before its first step with the message noted, "
              f"– {NOT_MEASURED}. Every cell trains {STEPS} optimizer steps (micro-batch {BATCH}, "
              f"`logging_steps=1`) of a tiny model on the CPU with `default_callbacks()`, reporting to TensorBoard; "
              f"the settings that save or evaluate do so every step. Metrics reach the reporters: every step has "
              f"`perf/`, `mem/` and `tuner/` keys in `log_history`, every callback key there reached each reporter "
              f"at that step, and every step's line in `perf_log.jsonl` holds them with the trainer's own "
              f"`log/loss`. Re-size exact, resume exact (`tests/test_compat_resize.py`): the cell trained "
              f"{RESIZE_STEPS} steps ({RESIZE_PER_EPOCH} an epoch) with SGD and momentum, an out-of-memory error "
              f"planted in step {RESIZE_FAULT_AT}'s forward re-sizes "
              f"{BATCH}×1 → 1×{BATCH} in the same process, and a fresh trainer resumes the recovery checkpoint at "
              f"1×{BATCH} as a new process does; each trains the unfaulted run's samples (GRPO: its completions), "
              f"RNG stream, learning rates, weights and optimizer state. Versions: " +
              ", ".join(f"{name}\0{version}" for name, version in pinned_versions().items()) +
              " (`constraints.txt`); on CI's oldest set the cells are checked too, without changing the table.")
    lines = [textwrap.fill(legend, width=118, break_on_hyphens=False, break_long_words=False).replace("\0", " "),
             "",
             "| setting | " + " | ".join(TRAINERS) + " |",
             "|---" * (len(TRAINERS) + 1) + "|"]
    notes: list[str] = []
    for setting in SETTINGS:
        row = [f"`{setting.name}`" if setting.name != "defaults" else "the trainer's defaults"]
        for trainer in TRAINERS:
            cell = Cell(setting, trainer)
            row.append(" · ".join(_mark(results.get(cell.id, {}).get(column), cell, notes) for column in COLUMNS))
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def _mark(outcome: str | None, cell: Cell, notes: list[str]) -> str:
    if outcome is None:
        return "–"
    kind, _, detail = outcome.partition(": ")
    if not detail:
        return MARKS[kind]
    text = f"{cell.trainer}, `{cell.setting.name}`: {detail}"
    if not any(note.endswith(f". {text}") for note in notes):          # the cell's other columns: one note
        notes.append(f"{len(notes) + 1}. {text}")
    return f"{MARKS[kind]} ({next(i for i, note in enumerate(notes, 1) if note.endswith(f'. {text}'))})"


def split_readme(text: str) -> tuple[str, str, str]:
    """(before, table, after) around the markers; a ``ValueError`` naming them when they are missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no compatibility table markers: expected {BEGIN!r} and then {END!r}")
    before, rest = text.split(BEGIN, 1)
    table, after = rest.split(END, 1)
    return before + BEGIN, table.strip("\n") + "\n", END + after


def main() -> int:
    with open(README, encoding="utf-8") as f:
        before, _, after = split_readme(f.read())
    with open(README, "w", encoding="utf-8") as f:
        f.write(f"{before}\n{render(load_results())}{after}")
    print(f"wrote the compatibility table into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
