"""``hf-perf report OUTPUT_DIR``: the whole report of a run, for the command line, the demo and the recipe launcher.

It reads the run log once and hands it to the three readers that never import each other: the summary
(:mod:`.summary`), the plots (:mod:`.plots`) and the written analysis (``perf_report.md``).
The written analysis needs no plotting: without matplotlib the plots are skipped with one line and
everything else is written.
"""
from __future__ import annotations

import sys

from ..core.runlog import ReportError, read_run
from .plots import plot_all
from .render import console_summary, write_analysis
from .summary import summarize

#: the one line printed instead of the plots when matplotlib is missing
NO_MATPLOTLIB = ("plots: skipped, matplotlib is not installed (pip install 'hf-perf-callbacks[plots]'; --no-plots "
                 "skips them without this line)")


def report_command(output_dir: str, plots: bool = True, summary: bool = True) -> int:
    """Print the run's summary and write its plots, then write ``perf_report.md`` and print the top findings.
    ``summary=False``: without the summary (a run that just printed its callbacks' summaries: the demo, the recipe
    launcher). 0 on success (also when the plots were skipped for want of matplotlib), 2 (message on stderr) when
    the directory cannot be reported on, 1 when only the analysis failed."""
    missing_matplotlib = False
    if plots:
        try:
            import matplotlib  # noqa: F401 - only whether it imports
        except ImportError:
            missing_matplotlib = True
    try:
        run = read_run(output_dir)
        if summary:
            print(summarize(run))
        if plots and not missing_matplotlib:
            written, skipped = plot_all(run, None)
            print("plots:")
            for png in written:
                print(f"  {png}")
            for note in skipped:
                print(f"  ({note})")
    except ReportError as error:
        print(f"hf-perf report: {error}", file=sys.stderr)
        return 2
    if missing_matplotlib:
        print(NO_MATPLOTLIB)
    try:
        path, findings, notes = write_analysis(run)
    except Exception as error:  # noqa: BLE001 - the summary and plots above stand on their own
        print(f"hf-perf report: the analysis failed ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    print(console_summary(findings, notes=notes))
    print(f"analysis: {path}")
    return 0
