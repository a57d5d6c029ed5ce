"""The analysis' English has one owner: :mod:`hf_perf_callbacks.report.words` renders each finding and note from its
reason code and facts. Checked here as data: every reason code has its renderer, and the modules that define the
rules build no sentence themselves (the shared helpers ``advice``, ``basis`` and ``formulas`` still phrase a few
figures — a memory limit hit, a calibration, a formula — that the renderers take as given)."""
from __future__ import annotations

import ast
import os

from hf_perf_callbacks.report import words
from hf_perf_callbacks.report.model import REASONS

RULES_DIR = os.path.join(os.path.dirname(words.__file__), "rules")


def _module_of_rule() -> dict[str, str]:
    """rule name → the module under report/rules that defines ``rule_<name>``."""
    out = {}
    for name in os.listdir(RULES_DIR):
        if name.endswith(".py") and name != "__init__.py":
            tree = ast.parse(open(os.path.join(RULES_DIR, name)).read())
            out.update({n.name.removeprefix("rule_"): name[:-3] for n in tree.body
                        if isinstance(n, ast.FunctionDef) and n.name.startswith("rule_")})
    return out


def test_every_reason_code_has_its_renderer():
    modules = _module_of_rule()
    assert set(modules) == set(REASONS)
    assert set(words.RENDERED_MODULES) == set(modules.values())     # every module that defines a rule
    codes = {c for cs in REASONS.values() for c in cs}
    assert codes == set(words.FINDING_WORDS) | set(words.NOTE_WORDS)


def _sentences(path: str) -> list[tuple[int, str]]:
    """The string literals and f-strings of three or more words in a module, outside docstrings and the rule cards
    (``@card(...)``: the rule table's documentation)."""
    tree = ast.parse(open(path).read())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            skip.add(id(node.body[0].value))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "card":
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.Dict):
            skip.update(id(n) for k in node.keys if k is not None for n in ast.walk(k))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if len(text.split()) >= 3:
            found.append((node.lineno, text))
    return found


def test_the_rule_modules_build_no_sentence():
    for module in words.RENDERED_MODULES:
        assert _sentences(os.path.join(RULES_DIR, f"{module}.py")) == [], module
    assert _sentences(os.path.join(RULES_DIR, "advice.py")), "the check finds the shared helpers' phrases"
