"""The report's wing (``hf-perf report OUTPUT_DIR``): pure readers of a run's ``perf_log.jsonl`` (no torch, no
transformers; importing this package imports no matplotlib).

=====================  ================================================================================================
module                 holds
=====================  ================================================================================================
:mod:`.command`        ``report_command``: reads the run once, hands it to the summary, the plots and the analysis
:mod:`.figures`        the headline figures every reader prints (computed once per run)
:mod:`.summary`        the text summary (``summarize``)
:mod:`.plots`          the PNG plots (matplotlib, the ``plots`` extra; imported only when drawing)
:mod:`.model`          the analysis' typed model: ``Measurements``, ``Finding``, ``Note``, the evidence thresholds
:mod:`.reading`        a run read into ``Measurements`` (``measurements``, ``measurements_from_run``)
:mod:`.rules`          the rules by family (``rules.grpo``, ``.memory``, ``.machine``, ``.step``, ``.run``), ``check``
:mod:`.render`         ``perf_report.md`` and the console's top findings
=====================  ================================================================================================
"""
from .command import report_command
from .model import Finding, Measurements, Note
from .reading import measurements, measurements_from_run
from .render import console_summary, gain_text, render_markdown, write_analysis
from .rules import RULES, check
from .summary import summarize

__all__ = ["RULES", "Finding", "Measurements", "Note", "check", "console_summary", "gain_text",
           "measurements", "measurements_from_run", "render_markdown", "report_command", "summarize",
           "write_analysis"]
