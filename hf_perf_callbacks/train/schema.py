"""The recipe's fields as the installed TRL and transformers define them, read from their source files with ``ast``,
without importing them (importing ``GRPOConfig`` imports torch and transformers: 7 s on an idle 2-core CPU, 43-55 s
on a busy one). The launcher checks a recipe against these stand-ins before anything heavy loads
(:func:`~hf_perf_callbacks.train.arguments.early_classes`); the real classes parse it afterwards.

- :func:`stand_in`: a dataclass with the fields of a class read from its source (names, resolved types, literal
  defaults, metadata);
- :func:`class_fields`: the fields of a dataclass read from its source;
- :func:`init_parameters`: the keyword parameters of a class's ``__init__`` (its own or a base's).

A class is found by following its module's imports (``from .x import C``, and the lazy packages' ``__init__`` that
import their names under ``TYPE_CHECKING``); an annotation is evaluated with ``typing``'s names, an ``Enum`` read
from its source (``IntervalStrategy``: its values), and :class:`Unresolved` for any other class (a check passes it:
the library's own parse checks it later). A default that is not a literal (an expression, a factory other than
a literal ``lambda``, ``list`` or ``dict``) is :data:`UNKNOWN`. Anything this reader cannot follow raises
:class:`SourceUnreadable`, and the launcher imports the real classes instead. ``tests/test_recipes.py`` checks the
stand-ins against the real classes on the installed versions. Standard library only.
"""
from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import enum
import functools
import importlib.util
import os
import typing
from dataclasses import dataclass
from typing import Any


class SourceUnreadable(Exception):
    """A class or module this reader cannot follow (the caller imports the real class instead)."""


class Unresolved(str):
    """The type of an annotation naming a class that is not read here (``ParallelismConfig``): a command-line value
    stays the string it is; the library's own parse converts and checks it."""


#: a default that is not a literal (``field(default=os.environ.get(...))``, ``default_factory=SomeClass``)
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "<unknown default>"})()

_TYPING = {name: getattr(typing, name) for name in ("Any", "Optional", "Union", "Literal", "Dict", "List", "Tuple",
                                                    "Callable", "Type", "Set")}
_BUILTINS = {name: getattr(builtins, name) for name in ("int", "float", "str", "bool", "dict", "list", "tuple", "set",
                                                        "bytes", "object", "type")}


@dataclass(frozen=True)
class Field:
    """One field as its source writes it: the annotation resolved to a type, its default (or :data:`UNKNOWN`), and
    whether it has one at all."""

    name: str
    type: Any                           # a resolved annotation: a class, a Union, a Literal, ...
    default: Any = dataclasses.MISSING  # MISSING: required; UNKNOWN: not a literal
    factory: bool = False               # the default came from a default_factory (a fresh copy per instance)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- modules and classes
@functools.cache
def module_file(module: str) -> str:
    """The source file of ``module`` (``trl.trainer.grpo_config``) found without importing it: the top-level
    package's spec (a finder lookup, nothing executed), then the submodule's path under it."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as error:
        raise SourceUnreadable(f"{top}: {error}") from None
    if spec is None:
        raise SourceUnreadable(f"no module named {top!r}")
    roots = list(spec.submodule_search_locations or [])
    if not rest:
        if spec.origin and spec.origin.endswith(".py"):
            return spec.origin
        raise SourceUnreadable(f"{module}: no source file")
    for root in roots:
        base = os.path.join(root, *rest)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    raise SourceUnreadable(f"{module}: no source file under {roots}")


@functools.cache
def _parsed(module: str) -> ast.Module:
    with open(module_file(module), encoding="utf-8") as handle:
        return ast.parse(handle.read())


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` in ``module`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    is_package = os.path.basename(module_file(module)) == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(module: str, name: str) -> str | None:
    """The module ``module`` imports ``name`` from (at any depth of its tree: ``if TYPE_CHECKING:`` included)."""
    for node in ast.walk(_parsed(module)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name and alias.name == name:
                    return _absolute(module, node)
    return None


def find_class(module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef]:
    """``(module, ClassDef)`` of the class ``name`` as seen from ``module``: defined there, or followed through its
    imports (a lazy package's ``__init__`` re-exporting it)."""
    if depth > 8:
        raise SourceUnreadable(f"{module}.{name}: too many imports to follow")
    for node in _parsed(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    source = _imported(module, name)
    if source is None:
        raise SourceUnreadable(f"{module}: no class {name!r} and no import of it")
    return find_class(source, name, depth + 1)


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
        else:
            raise SourceUnreadable(f"class {node.name}: a base written as {ast.unparse(base)!r}")
    return names


_ENUM_BASES = {"Enum", "ExplicitEnum", "StrEnum", "IntEnum"}


def _enum(module: str, node: ast.ClassDef, depth: int = 0) -> type[enum.Enum] | None:
    """The Enum ``node`` defines (its literal members), or None when it is not an enum."""
    bases = _base_names(node)
    if not _ENUM_BASES & set(bases):
        for base in bases:
            if base in _BUILTINS or depth > 4:
                continue
            try:
                found = find_class(module, base)
            except SourceUnreadable:
                continue
            if _enum(*found, depth=depth + 1) is not None:
                break
        else:
            return None
    members = []
    for statement in node.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name):
            try:
                members.append((statement.targets[0].id, ast.literal_eval(statement.value)))
            except ValueError:
                raise SourceUnreadable(f"enum {node.name}: a member that is not a literal") from None
    mixin = str if {"str", "ExplicitEnum", "StrEnum"} & set(bases) else None
    made: type[enum.Enum] = enum.Enum(node.name, members, type=mixin)   # type: ignore[misc]  # a name read here
    return made


# ---------------------------------------------------------------- annotations and defaults
def _resolve(module: str, annotation: ast.expr) -> Any:           # a type, a Union, a Literal...
    """An annotation evaluated: typing's and the builtins' names as they are, an Enum read from its source, any
    other class as :class:`Unresolved`."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):      # a string annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    namespace: dict[str, Any] = {"__builtins__": {}, "None": None, **_TYPING, **_BUILTINS, "typing": typing}
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id not in namespace:
            namespace[node.id] = _named_type(module, node.id)
    try:
        return eval(compile(ast.Expression(annotation), "<annotation>", "eval"), namespace)   # the annotation's own AST
    except Exception as error:                                      # noqa: BLE001 - an annotation not read here
        raise SourceUnreadable(f"{module}: annotation {ast.unparse(annotation)!r}: {error}") from None


def _named_type(module: str, name: str) -> Any:                   # an Enum, or Unresolved
    try:
        found = find_class(module, name)
    except SourceUnreadable:
        return Unresolved
    return _enum(*found) or Unresolved


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return UNKNOWN


def _factory(node: ast.expr) -> Any:
    """A ``default_factory``'s value: a literal ``lambda: ...``, ``list``, ``dict``; else :data:`UNKNOWN`."""
    if isinstance(node, ast.Lambda):
        return _literal(node.body)
    if isinstance(node, ast.Name) and node.id in ("list", "dict", "set", "tuple"):
        return _BUILTINS[node.id]()
    return UNKNOWN


def _is_field_call(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Call) and (isinstance(node.func, ast.Name) and node.func.id == "field"
                                           or isinstance(node.func, ast.Attribute) and node.func.attr == "field")


def _field(module: str, statement: ast.AnnAssign) -> Field | None:
    """One dataclass field; None for a ``ClassVar`` or a field with ``init=False`` (no constructor argument)."""
    assert isinstance(statement.target, ast.Name)
    name = statement.target.id
    if "ClassVar" in ast.unparse(statement.annotation):
        return None
    hint = _resolve(module, statement.annotation)
    value = statement.value
    if value is None:
        return Field(name, hint)
    if not _is_field_call(value):
        return Field(name, hint, _literal(value))
    assert isinstance(value, ast.Call)
    keywords = {k.arg: k.value for k in value.keywords if k.arg}
    if "init" in keywords and _literal(keywords["init"]) is False:
        return None
    metadata = _literal(keywords["metadata"]) if "metadata" in keywords else {}
    metadata = metadata if isinstance(metadata, dict) else {}
    if "default" in keywords:
        return Field(name, hint, _literal(keywords["default"]), metadata=metadata)
    if "default_factory" in keywords:
        return Field(name, hint, _factory(keywords["default_factory"]), factory=True, metadata=metadata)
    return Field(name, hint, metadata=metadata)


@functools.cache
def class_fields(module: str, name: str) -> tuple[Field, ...]:
    """The constructor fields of the dataclass ``name`` (seen from ``module``), its bases' first, a field a
    subclass declares again in its base's place (as ``dataclasses`` orders them)."""
    where, node = find_class(module, name)
    fields: dict[str, Field | None] = {}
    for base in _base_names(node):
        if base in ("object", "Generic"):
            continue
        fields.update((f.name, f) for f in class_fields(where, base))
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            found = _field(where, statement)
            fields[statement.target.id] = found
    return tuple(f for f in fields.values() if f is not None)


def stand_in(module: str, name: str) -> type:
    """A dataclass named ``name`` with the fields of the class read from ``module``'s source: what TRL's parser
    needs to parse and check a recipe the way it parses it with the real class (flags, types, defaults, choices).
    A default not read here is None."""
    specs = []
    for f in class_fields(module, name):
        options: dict[str, Any] = {"metadata": f.metadata}
        default = None if f.default is UNKNOWN else f.default
        if f.default is dataclasses.MISSING:
            pass
        elif f.factory or isinstance(default, (list, dict, set)):
            options["default_factory"] = functools.partial(copy.deepcopy, default)
        else:
            options["default"] = default
        specs.append((f.name, f.type, dataclasses.field(**options)))
    return dataclasses.make_dataclass(name, specs)


def init_parameters(module: str, name: str) -> dict[str, Field] | None:
    """The keyword parameters of the class ``name``'s ``__init__`` (its own, or the nearest base's), each with its
    resolved annotation and literal default; None when it takes ``**kwargs`` (any name goes)."""
    where, node = find_class(module, name)
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            args = statement.args
            if args.kwarg is not None:
                return None
            positional = args.posonlyargs + args.args
            defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
            params = list(zip(positional, defaults))[1:] + list(zip(args.kwonlyargs, args.kw_defaults))
            return {arg.arg: Field(arg.arg, _resolve(where, arg.annotation) if arg.annotation else Any,
                                   dataclasses.MISSING if value is None else _literal(value))
                    for arg, value in params}
    for base in _base_names(node):
        if base not in ("object", "Generic"):
            return init_parameters(where, base)
    return {}
