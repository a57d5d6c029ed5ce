"""The analysis' English has one owner: :mod:`hf_perf_callbacks.report.words` renders each finding and note from its
reason code and facts (a frozen dataclass per case, ``report/facts.py``). Checked here as data: every reason code has
its renderer, every figure a renderer reads is a field of its case's class, and the modules that define the rules and
their shared helpers build no sentence (``formulas`` writes the memory formulas: numbers with their factors' names)."""
from __future__ import annotations

import ast
import os
from typing import get_args

import pytest

from hf_perf_callbacks.report import words
from hf_perf_callbacks.report.model import Reason

RULES_DIR = os.path.join(os.path.dirname(words.__file__), "rules")
#: the rule modules (under ``report/rules``) whose every result is worded by ``report/words.py``: all that define a rule
RENDERED_MODULES = ("phases", "run", "machine", "step", "grpo", "memory")

#: each rule's reason codes (model.Reason lists them all)
REASONS: dict[str, tuple[str, ...]] = {
    "no_learning": ("no_reward_data", "too_few_logs", "constant_reward", "no_group_variance"),
    "memory_pressure": ("swapping", "near_the_wall", "pressure"),
    "oversubscription": ("threads_over_free_cores",),
    "contention": ("other_processes", "contention_below_share", "unexplained_stretches"),
    "evaluation": ("eval_share",), "saving": ("save_share",), "callbacks": ("logging_share", "one_callback"),
    "input_bound": ("no_workers", "workers_behind"), "recompute": ("memory_to_spare", "would_not_fit"),
    "duplicate_forward": ("grad_forwards",),
    "padding_waste": ("fixed_length", "pad_to_multiple", "grpo_inherent", "one_length_unsure", "per_batch"),
    "generation_bound": ("launch_bound", "generation_share"), "weight_sync": ("sync_share",),
    "rollout_wait": ("waits_for_rollouts",),
    "tuning_cost": ("cost_over_saving",),
    "small_micro_batch": ("small_split", "memory_cap", "tuner_measured", "tuner_measured_none"),
    "tuner_hint": ("needs_train_with_tuning",), "completion_budget": ("cut_off", "runaways", "no_runaways"),
    "warmup": ("not_finished", "first_step_steady", "excluded"), "evidence": ("too_few_steps",),
    "log_fields": ("skipped",), "reward": ("reward_share",), "compile": ("recompiles", "recompiles_small"),
    "scope": ("stand_in", "kept_for_recipe"),
}


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
    assert set(RENDERED_MODULES) == set(modules.values())     # every module that defines a rule
    codes = [c for cs in REASONS.values() for c in cs]
    assert len(codes) == len(set(codes)) and set(codes) == set(get_args(Reason))     # each code of one rule
    assert set(codes) == set(words.FINDING_WORDS) | set(words.NOTE_WORDS)


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
    for module in [*RENDERED_MODULES, "advice", "basis"]:    # the rules and their shared helpers (formulas.py
        #                                                            writes formulas: numbers with their factors' names)
        assert _sentences(os.path.join(RULES_DIR, f"{module}.py")) == [], module
    assert _sentences(words.__file__), "the check finds the renderers' sentences"


def _reads(render: ast.FunctionDef, functions: dict[str, ast.FunctionDef]) -> set[str]:
    """The attributes a renderer reads on its first parameter, through the helpers it hands that parameter to."""
    name = render.args.args[0].arg
    found: set[str] = set()
    for node in ast.walk(render):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
            found.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions \
                and any(isinstance(a, ast.Name) and a.id == name for a in node.args[:1]):
            found |= _reads(functions[node.func.id], functions)
    return found


def test_every_figure_a_renderer_reads_is_a_field_of_its_facts_class():
    """A rule hands its words a frozen dataclass per reason code (``report/facts.py``): a renamed or misspelled
    figure fails strict mypy in the rule that builds it and in the renderer that reads it; and here, without mypy:
    every attribute a renderer (and each helper it hands its facts to) reads on its facts is a field of the class
    its annotation names, the class a rule must hand it (:func:`~hf_perf_callbacks.report.words.finding` refuses
    another)."""
    import dataclasses

    tree = ast.parse(open(words.__file__).read())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    checked = 0
    for table in (words.FINDING_WORDS, words.NOTE_WORDS):
        for reason, (render, cls) in table.items():
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = _reads(functions[render.__name__], functions) - fields
            assert not unknown, (reason, cls.__name__, unknown)
            checked += 1
    assert checked == len({c for cs in REASONS.values() for c in cs})
    # the check fails on a renamed figure: a renderer reading a field its class does not have
    fake = ast.parse("def _save_share(f: SaveShare, setting):\n    return f.saves_sec\n").body[0]
    assert _reads(fake, {}) - {f.name for f in dataclasses.fields(words.FINDING_WORDS["save_share"][1])} == \
        {"saves_sec"}


def test_a_rule_handing_another_case_its_facts_is_refused():
    from hf_perf_callbacks.report.facts import Skipped

    with pytest.raises(TypeError, match="save_share"):
        words.finding("saving", "save_share", Skipped(()), {}, None, "high", "measured", None)
