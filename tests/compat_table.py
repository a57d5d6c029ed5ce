"""The compatibility table of ``docs/compatibility.md``, rendered from the matrix's recorded results
(``tests/compat_results.json``, written by the matrix's tests through :func:`tests.compat.record`), never written
by hand.

``python -m tests.compat_table`` writes it into ``docs/compatibility.md`` between :data:`BEGIN` and :data:`END`;
``tests/test_compat_matrix.py`` fails while that table differs from what the recorded results render.
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
    TUNING,
    TUNING_COLUMNS,
    Cell,
    load_results,
    pinned_versions,
)

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "compatibility.md")
BEGIN = "<!-- compat-table: rendered by `python -m tests.compat_table` from tests/compat_results.json -->"
END = "<!-- compat-table: end -->"
MARKS = {"yes": "✓", "no": "✗", "refused": "refused", "said": "said", "rule": "rule", "measured": "measured"}
NOT_APPLICABLE = "n/a"


def render(results: dict) -> str:
    """The tables (markdown) with their legends and the messages of refused, said and failed cells as numbered
    notes (one list for both tables)."""
    columns = " · ".join(COLUMNS.values())
    legend = (f"Each cell: {columns}. ✓ the tests showed it, ✗ they showed it does not hold (why in the note), "
              f"refused: the trainer refuses the setting before its first step with the message noted, said: the "
              f"setting leaves no other split exact, so the run keeps its configured split, says why at the start "
              f"(console, `perf_log.jsonl`, `tuner_split.json`) and an out-of-memory error saves and ends it with "
              f"that reason and the setting that makes every split exact (the cell also re-sizes once with the "
              f"rule off, to check that the restriction was needed), {NOT_APPLICABLE}: the setting does not exist "
              f"for that trainer, – {NOT_MEASURED}. Every cell trains {STEPS} optimizer steps (micro-batch {BATCH}, "
              f"`logging_steps=1`) of a tiny model on the CPU with `default_callbacks()`, reporting to TensorBoard; "
              f"the settings that save or evaluate do so every step. Metrics reach the reporters: every step has "
              f"`perf/`, `mem/` and `tuner/` keys in `log_history`, every callback key there reached each reporter "
              f"at that step, and every step's line in `perf_log.jsonl` holds them with the trainer's own "
              f"`log/loss`. Re-size exact, resume exact (`tests/test_compat_resize.py`): the cell trained "
              f"{RESIZE_STEPS} steps ({RESIZE_PER_EPOCH} an epoch) with SGD and momentum and no gradient clipping "
              f"(clipping rescales the gradient and can hide a difference), an out-of-memory error "
              f"planted in step {RESIZE_FAULT_AT}'s forward re-sizes "
              f"{BATCH}×1 → 1×{BATCH} (a setting of `gradient_accumulation_steps=2`: {BATCH}×2 → 1×{2 * BATCH}) in "
              f"the same process, and a fresh trainer resumes the recovery checkpoint at the new split as a new "
              f"process does; each trains the unfaulted run's samples (GRPO: its completions), RNG stream, "
              f"learning rates, weights and optimizer state. The plain Trainer's collator pads right, as training "
              f"does, except in the `padding_side=left` row. Exact by: ✓ the step the new split started with showed it "
              f"(the check of the change on that step's rows: the new split's gradients against the old split's, "
              f"`hf_perf_callbacks/resize/exactness.py`), measured: the check showed the new split trains something "
              f"else, rule: the settings list refused the smaller splits before any check (why noted). Versions: " +
              ", ".join(f"{name}\0{version}" for name, version in pinned_versions().items()) +
              " (`constraints.txt`); on CI's oldest set the cells are checked too, without changing the table.")
    lines = [_fill(legend), "", "| setting | " + " | ".join(TRAINERS) + " |", "|---" * (len(TRAINERS) + 1) + "|"]
    notes: list[str] = []
    for setting in SETTINGS:
        row = [f"`{setting.name}`" if setting.name != "defaults" else "the trainer's defaults"]
        for trainer in TRAINERS:
            cell = Cell(setting, trainer)
            row.append(" · ".join(_mark(results.get(cell.id, {}).get(column), cell, notes) for column in COLUMNS)
                       if trainer in setting.only else NOT_APPLICABLE)
        lines.append("| " + " | ".join(row) + " |")
    tuning = ("The tuning and what the user set (`tests/test_compat_tuning.py`): each cell runs "
              "`train_with_tuning` with the tuning on (planted step times, so it switches splits on the run's own "
              "steps: 2×2 → 4×1 after its first measurements), and compares it with the same run untuned: it ends "
              "at the same step with the same samples, RNG stream, learning rates, weights and optimizer state; "
              "the trial's out-of-memory errors spend none of `max_resizes`; no checkpoint of the user's is lost "
              "to `save_total_limit`; `args`, `tuner_split.json` and the tuning's decision name the same split.")
    lines += ["", _fill(tuning), "", "| what happens | " + " | ".join(TRAINERS) + " |",
              "|---" * (len(TRAINERS) + 1) + "|"]
    for scenario in TUNING:
        row = [scenario.name]
        for trainer in TRAINERS:
            cell = Cell(scenario, trainer)
            row.append(" · ".join(_mark(results.get(cell.id, {}).get(column), cell, notes)
                                  for column in TUNING_COLUMNS) if trainer in scenario.only else NOT_APPLICABLE)
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def _fill(text: str) -> str:
    return textwrap.fill(text, width=118, break_on_hyphens=False, break_long_words=False).replace("\0", " ")


def _mark(outcome: str | None, cell: Cell, notes: list[str]) -> str:
    if outcome is None:
        return "–"
    kind, _, detail = outcome.partition(": ")
    if not detail:
        return MARKS[kind]
    if not any(note.endswith(f". {detail}") for note in notes):        # the same words anywhere: one note
        notes.append(f"{len(notes) + 1}. {detail}")
    return f"{MARKS[kind]} ({next(i for i, note in enumerate(notes, 1) if note.endswith(f'. {detail}'))})"


def split_doc(text: str) -> tuple[str, str, str]:
    """(before, table, after) around the markers; a ``ValueError`` naming them when they are missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"docs/compatibility.md has no compatibility table markers: expected {BEGIN!r}, then "
                         f"{END!r}")
    before, rest = text.split(BEGIN, 1)
    table, after = rest.split(END, 1)
    return before + BEGIN, table.strip("\n") + "\n", END + after


def main() -> int:
    with open(DOC, encoding="utf-8") as f:
        before, _, after = split_doc(f.read())
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(f"{before}\n{render(load_results())}{after}")
    print(f"wrote the compatibility table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
