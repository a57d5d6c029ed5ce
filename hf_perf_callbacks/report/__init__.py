"""The report's wing (``hf-perf report OUTPUT_DIR``): pure readers of a run's ``perf_log.jsonl``.

========================  =============================================================================================
module                    holds
========================  =============================================================================================
:mod:`.command`           ``report_command``: reads the run once, hands it to the summary, the plots and the analysis
:mod:`.figures`           the headline figures every reader prints (one computation per run)
:mod:`.summary`           the text summary (``summarize``)
:mod:`.plots`             the PNG plots (matplotlib, the ``plots`` extra; imported only when drawing)
========================  =============================================================================================

No module here imports torch or transformers; importing this package imports no matplotlib.
"""
from .command import report_command
from .summary import summarize

__all__ = ["report_command", "summarize"]
