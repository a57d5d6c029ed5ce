"""The suite never asserts on the machine's speed: an AST scan of every test file for an ``assert`` whose test reads
the real clock (``time.time()``, ``time.perf_counter()``, ``time.monotonic()``, ``time.process_time()`` and their
``_ns`` forms), directly or through a name assigned from it in the same function (``start = time.perf_counter()``
... ``elapsed = time.perf_counter() - start``; ``assert elapsed < 5``). A test that needs a duration plants it
(``tests/conftest.py: PlantedClock``); CI is a shared 2-core machine where a step takes 0.1 s or 48 s."""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "time_ns", "perf_counter_ns", "monotonic_ns",
          "process_time_ns"}


def _reads_clock(node: ast.AST, tainted: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in CLOCKS and isinstance(func.value, ast.Name) \
                    and func.value.id == "time":
                return True
            if isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}:      # from time import perf_counter
                return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def wall_clock_asserts(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of each assert on the real clock in ``source`` (see the module docstring)."""
    found = []
    tree = ast.parse(source)
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        tainted: set[str] = set()
        for _ in range(3):                               # names from names from the clock
            for node in ast.walk(function):
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None \
                        and _reads_clock(node.value, tainted):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        for node in ast.walk(function):
            if isinstance(node, ast.Assert) and _reads_clock(node.test, tainted):
                found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def test_no_test_asserts_on_the_real_clock():
    found = [hit for path in sorted(TESTS.rglob("*.py"))
             for hit in wall_clock_asserts(path.read_text(encoding="utf-8"), str(path.relative_to(TESTS.parent)))]
    assert found == [], "asserts on the machine's own clock (plant the seconds instead: PlantedClock): " + \
        ", ".join(found)


def test_the_scan_finds_a_wall_clock_assert_and_passes_a_planted_one():
    direct = "import time\ndef test_a():\n    start = time.perf_counter()\n    run()\n" \
             "    elapsed = time.perf_counter() - start\n    assert elapsed < 5\n"
    inline = "from time import monotonic\ndef test_b():\n    assert monotonic() > 0\n"
    planted = "def test_c():\n    clock = PlantedClock()\n    clock.spend(100)\n    assert clock.planted == 100\n"
    assert wall_clock_asserts(direct) == ["<test>:6"]
    assert wall_clock_asserts(inline) == ["<test>:3"]
    assert wall_clock_asserts(planted) == []
