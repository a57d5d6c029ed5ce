"""How the tests themselves are written: they assert data (findings, decisions, events, exit codes, logged values);
the rendered English is checked by the golden files of ``tests/test_golden.py`` and by a few tests whose point is a
sentence. This counts the test functions that assert on an English string literal (two words or more)."""
from __future__ import annotations

import ast
import glob
import os
import re

#: the largest share of test functions allowed to assert on an English phrase
MAX_ENGLISH_SHARE = 0.15
#: the test functions that assert English today: a ratchet, lowered as tests move to data, never raised
ENGLISH_CEILING = 104
WORDS = re.compile(r"[A-Za-z]{3,} [A-Za-z]{2,}")
TESTS = os.path.dirname(__file__)


def _english(node: ast.AST) -> bool:
    for c in ast.walk(node):
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and WORDS.search(c.value):
            return True
        if isinstance(c, ast.JoinedStr):
            literal = "".join(v.value for v in c.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if WORDS.search(literal):
                return True
    return False


def english_tests(paths: list[str]) -> tuple[int, list[str]]:
    """(test functions in ``paths``, those whose ``assert`` conditions hold an English phrase as ``file::name``)."""
    total, english = 0, []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                total += 1
                if any(isinstance(a, ast.Assert) and _english(a.test) for a in ast.walk(node)):
                    english.append(f"{os.path.basename(path)}::{node.name}")
    return total, english


def test_the_counter_finds_an_english_assert_and_passes_a_data_one(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("def test_a():\n    assert 'the wall moved' in text\n\n"
                    "def test_b():\n    assert f.setting == {'eval_steps': 50} and f.rule == 'eval'\n\n"
                    "def test_c():\n    assert f'{n} steps ran' in text\n")
    assert english_tests([str(path)]) == (3, ["test_x.py::test_a", "test_x.py::test_c"])


def _suite() -> tuple[int, list[str]]:
    return english_tests(sorted(glob.glob(os.path.join(TESTS, "test_*.py"))))


def test_the_english_asserts_only_ever_fall():
    total, english = _suite()
    assert total > 0 and len(english) <= ENGLISH_CEILING, (len(english), total, english)


def test_at_most_a_small_share_of_tests_assert_english():
    total, english = _suite()
    assert total > 0 and len(english) <= MAX_ENGLISH_SHARE * total, (len(english), total, english)
