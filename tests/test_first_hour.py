"""The first hour's page is true to the project: the README's extras are pyproject.toml's, the two commands' times it
gives are the ones docs/performance.md records (with their load), and its line on what gives the Usage block steady
figures and an MFU names enough steps for the meter. (The newcomer's run itself, with its commands, times and load:
docs/performance.md#first-hour.)"""
from __future__ import annotations

import inspect
import os
import re

try:
    import tomllib
except ModuleNotFoundError:                          # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _names(text: str) -> set[str]:
    return {re.sub(r"[^a-z0-9]+", "-", word.strip().lower()).strip("-") for word in text.split(",") if word.strip()}


def test_the_readmes_extras_are_pyprojects():
    """Each extra of pyproject.toml is a row of the README's table, which names every package it adds."""
    extras = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]
    readme = read("README.md")
    install = readme[readme.index("\n## Install\n"):readme.index("\n## Two commands\n")]
    rows = dict(re.findall(r"^\| `([\w-]+)` \| ([^|]+) \|", install, re.M))
    assert set(rows) == set(extras)
    for extra, requirements in extras.items():
        wanted = {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0].lower() for r in requirements}
        assert wanted == _names(rows[extra]), (extra, wanted, rows[extra])


def test_the_readme_gives_the_two_commands_times_the_performance_page_records():
    """The README's times of `make demo` and `make test` (between its two-commands-time markers) are the figures of
    docs/performance.md's first-hour section, each with the load it was measured at."""
    (said,) = re.findall(r"<!-- two-commands-time -->(.*?)<!-- /two-commands-time -->", read("README.md"), re.S)
    page = read("docs", "performance.md")
    section = page[page.index("## First hour"):page.index("## The callbacks' own accuracy")]
    figures = re.findall(r"\d+ min(?: \d+ s)?|\d+(?:\.\d+)? s\b|\d+\.\d+", said)     # times, then loads
    assert len(figures) >= 5
    assert all(figure in section for figure in figures), [f for f in figures if f not in section]


def test_the_usage_blocks_line_names_enough_steps_for_steady_figures_and_a_measured_peak():
    from hf_perf_callbacks import ThroughputMeter

    text = read("README.md")
    usage = text[text.index("\n## Usage\n"):text.index("\n## What you get\n")]
    (steps,) = re.findall(r"for both, `max_steps=(\d+)`", usage)
    window = inspect.signature(ThroughputMeter).parameters["warmup_window"].default
    assert int(steps) >= 2 * window                 # the warmup detector's first decision needs 2 windows of steps
    assert 'default_callbacks(ThroughputMeter={"peak_flops": "calibrate"})' in usage
    assert "ThroughputMeter(peak_flops=" not in usage  # the hint in the form the block writes the callbacks in
