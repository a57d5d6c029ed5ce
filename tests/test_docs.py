"""The README is a front door to docs/, and docs/'s generated tables are what the code and the result files say:
the README's length, every relative link (and its #anchor) of the README and docs/ resolving, the metric key table
from ``keys.KEY_DOCS``, the performance tables from ``benchmarks/results/*.json``. (The compatibility table:
tests/test_compat_matrix.py; the rule table: tests/test_analysis.py.)"""
from __future__ import annotations

import glob
import os
import re

import pytest

from benchmarks import render_performance
from hf_perf_callbacks import keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
#: the README stays a front door: what it is, install, the two commands, the Usage block, what you get, links
README_MAX_LINES = 250
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [README, os.path.join(ROOT, "recipes", "README.md")]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def links(path: str) -> list[tuple[str, str]]:
    """The relative links of a markdown file as (target path, anchor); a link within the page has its path."""
    found = []
    for link in re.findall(r"\]\(([^)\s]+)\)", read(path)):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target, _, anchor = link.partition("#")
        found.append((os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path, anchor))
    return found


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation other than '-' and '_'
    dropped, spaces to '-' (code spans count by their text)."""
    found = set()
    in_code = False
    for line in read(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower().replace("`", "")
        found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def between(text: str, begin: str, end: str) -> str:
    start = text.index("\n", text.index(begin)) + 1
    return text[start:text.index(end, start)].strip("\n")


def test_the_readme_is_a_front_door_whose_docs_links_resolve():
    lines = read(README).splitlines()
    assert len(lines) <= README_MAX_LINES
    to_docs = [(target, anchor) for target, anchor in links(README) if target.startswith(DOCS + os.sep)]
    assert {os.path.basename(t) for t, _ in to_docs} >= {"architecture.md", "throughput.md", "watchdog.md",
                                                          "tuning.md", "exactness.md", "report.md", "keys.md",
                                                          "compatibility.md", "performance.md", "known-issues.md"}
    assert [t for t, _ in to_docs if not os.path.isfile(t)] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_and_anchor_resolves(page):
    missing = [(os.path.relpath(t, ROOT), a) for t, a in links(page) if not os.path.exists(t)]
    assert missing == []
    broken = [(os.path.relpath(t, ROOT), a) for t, a in links(page)
              if a and t.endswith(".md") and a not in anchors(t)]
    assert broken == []


def test_every_metric_key_has_its_unit_and_meaning_and_the_page_shows_them():
    """keys.KEY_DOCS covers exactly the metric keys keys.py defines, and docs/keys.md's table is the one
    ``python -m hf_perf_callbacks.keys`` prints."""
    defined = {key for value in vars(keys).values() if value is not keys.KEY_DOCS     # the constants, the phase dicts
               for key in (value.values() if isinstance(value, dict) else [value])
               if isinstance(key, str) and key.startswith(keys.CALLBACK_PREFIXES)}
    assert defined == set(keys.KEY_DOCS)
    assert all(unit and meaning and where in (keys.REPORTED, keys.PERF_LOG_ONLY)
               for unit, meaning, where in keys.KEY_DOCS.values())
    page = read(os.path.join(DOCS, "keys.md"))
    assert between(page, "<!-- key table:", "<!-- end of key table -->") == keys.key_table()


def test_the_performance_tables_are_rendered_from_the_result_files():
    """docs/performance.md's tables are what ``python -m benchmarks.render_performance`` renders from
    benchmarks/results, every result file has its row, and every row names a machine of the machines table."""
    results = render_performance.load()
    _, tables, _ = render_performance.split_doc(read(render_performance.DOC))
    assert tables == render_performance.render(results)
    machines = {line.split(" | ")[0].removeprefix("| ") for line in tables.split("\n\n")[0].splitlines()[2:]}
    rows = [line.split(" | ") for line in tables.split("\n\n")[1].splitlines()[2:]]
    assert [row[0].removeprefix("| ").strip("`") for row in rows] == [f"{name}.json" for name in results]
    assert {row[1] for row in rows} <= machines
