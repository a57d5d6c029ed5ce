"""The package's import graph has no circle: a module never imports (even only for type checking, even inside a
function) one that imports it back, directly or through others."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "hf_perf_callbacks"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package → the package modules it imports (relative imports resolved)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                named = {f"{base}.{a.name}" for a in node.names} & modules.keys()   # `from . import keys`
                targets = named or {base}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names}
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle found by a depth-first walk (one per back edge)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "hf_perf_callbacks.resize.executor" in graph["hf_perf_callbacks.resize.loop"]     # the graph is read
    assert cycles(graph) == []


def test_a_circle_is_found_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_name_the_docs_send_users_to_is_declared_public():
    """A name the README, docs/ or recipes/README.md write as ``hf_perf_callbacks.module.name`` is in that module's
    ``__all__`` (so the module declares its public surface), and every name a module declares exists."""
    import importlib
    import re

    root = PACKAGE.parent
    texts = [root / "README.md", root / "recipes" / "README.md", *sorted((root / "docs").glob("*.md"))]
    named = {m for t in texts for m in re.findall(r"hf_perf_callbacks(?:\.[A-Za-z_][A-Za-z0-9_]*)+", t.read_text())}
    checked, modules = 0, set()
    for dotted in sorted(named):
        parts = dotted.split(".")
        for cut in range(len(parts), 1, -1):                  # the longest importable prefix is the module
            try:
                module = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            rest = parts[cut:]
            modules.add(module.__name__)
            if rest:
                assert rest[0] in getattr(module, "__all__", ()), f"{dotted}: not in {module.__name__}.__all__"
                checked += 1
            break
    assert checked >= 3
    for module_name in modules | {"hf_perf_callbacks"}:
        module = importlib.import_module(module_name)
        if module_name.endswith(".main"):                       # a command (`python -m …main`), not an API
            continue
        assert "__all__" in vars(module), f"{module_name} is named in the docs and declares no __all__"
        assert all(hasattr(module, n) for n in module.__all__), module_name


def test_every_metric_key_constant_is_public():
    """A key added to keys.py is added to its ``__all__`` too (the constants are the public names of the keys)."""
    from hf_perf_callbacks import keys

    constants = {n for n in vars(keys) if n.isupper() and not n.startswith("_")}
    assert constants <= set(keys.__all__), sorted(constants - set(keys.__all__))


def layout_floors(text: str) -> dict[str, int]:
    """docs/architecture.md's table of floors: each file or folder it names (``resize/`` and ``resize/executor.py``)
    → its floor, counted from the lowest."""
    import re

    table = text[text.index("| floor | where | job |"):].split("\n\n")[0].splitlines()[2:]
    floors: dict[str, int] = {}
    for i, row in enumerate(table):
        for m in re.finditer(r"`([\w/]+/)` \(([^)]*)\)|`([\w/.]+)`", row.split("|")[2]):
            if m.group(1):
                floors[m.group(1)] = i
                floors.update({m.group(1) + f: i for f in re.findall(r"`([\w/.]+)`", m.group(2))})
            else:
                floors[m.group(3)] = i
    return floors


def floor_of(module: str, floors: dict[str, int]) -> int | None:
    parts = module.split(".")[1:]
    path = "/".join(parts)
    for name in (path + ".py", path + "/", path):
        if name in floors:
            return floors[name]
    for k in range(len(parts) - 1, 0, -1):                   # a module in a folder the table names as a whole
        if "/".join(parts[:k]) + "/" in floors:
            return floors["/".join(parts[:k]) + "/"]
    return None


def test_the_architecture_pages_floors_are_the_code_and_no_import_goes_up_a_floor():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    floors, graph = layout_floors(text), import_graph()
    unnamed = sorted(m for m in graph if m.count(".") and not m.endswith("__main__") and floor_of(m, floors) is None)
    assert unnamed == [], f"modules docs/architecture.md's table of floors does not name: {unnamed}"
    named = [n for n in floors if n.endswith(".py")]
    assert all((PACKAGE / n).exists() for n in named), [n for n in named if not (PACKAGE / n).exists()]
    up = sorted((a, b) for a, targets in graph.items() for b in targets
                if None not in (floor_of(a, floors), floor_of(b, floors)) and floor_of(b, floors) > floor_of(a, floors))
    assert up == [], f"imports up a floor: {up}"


def test_the_folders_are_the_floors_and_the_root_holds_what_its_rows_name():
    """Every folder of the package is named on one row of docs/architecture.md's table with every module in it, and
    every module at the root is named on its row: a module moved between folders, or added to the root, fails."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    floors = layout_floors(text)
    folders = sorted(d.name + "/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists())
    assert sorted(n for n in floors if n.endswith("/") and n.count("/") == 1) == folders
    for folder in ("core/", "platform/", "common/"):                      # listed whole, module by module
        inside = {f"{folder}{p.name}" for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"}
        assert inside == {n for n in floors if n.startswith(folder) and n != folder}, folder
        assert len({floors[n] for n in inside} | {floors[folder]}) == 1, folder
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert [n for n in root if n not in floors] == []
    assert not [n for n in floors if "/" not in n and not (PACKAGE / n).exists()]


def test_the_floor_check_finds_an_import_up_and_an_unnamed_module():
    floors = layout_floors("| floor | where | job |\n|---|---|---|\n| low | `keys.py` | x |\n"
                           "| high | `resize/` (`loop.py`) | y |\n\n")
    assert floors == {"keys.py": 0, "resize/": 1, "resize/loop.py": 1}
    assert floor_of("hf_perf_callbacks.resize.loop", floors) == 1 > floor_of("hf_perf_callbacks.keys", floors) == 0
    assert floor_of("hf_perf_callbacks.resize", floors) == 1
    assert floor_of("hf_perf_callbacks.common.bus", floors) is None
