"""A user's function named by an import path ("package.module:attr"): a reward function, a custom advantage
function. Checked at plan time without running any of the user's code; imported when the stage that calls it runs.

Plan time (`--dry-run`, config validation) must not execute a module's top-level code: importing it may start
servers, load models or write files. So the module is found the way the import system finds it (the finders on
sys.meta_path locate; only loaders execute), without importing its parent packages either, and its source is
parsed to see that the attribute is bound at top level. The real import (`import_reference`) happens when the
reward loop or the advantages stage runs.

What a static look cannot see is accepted here and checked at that import: a compiled module, a module-level
`__getattr__`, a `from x import *`, or an attribute inside a top-level object (`pkg.mod:Class.method`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

from rollout_lib.reward.verl import is_verl_signature, verl_kwargs_problem


def check_reference(spec: str, kwargs: dict | None = None, *,
                    what: str = "reward function") -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """Raise ValueError (naming `what` and `spec`) when the module cannot be found, the attribute is not defined at
    its top level, or kwargs name a parameter the function does not take. Returns the function's definition when
    `spec` names a top-level `def` (None: what a static look cannot see)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{what} {spec!r}: expected an import path 'package.module:attr'")
    module_spec = find_module_spec(module_name)
    if module_spec is None:
        raise ValueError(f"{what} {spec!r}: cannot find module {module_name!r} on the Python path")
    source = _python_source(module_spec)
    if source is None:
        return None  # compiled or source-less: only importing it can tell
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except SyntaxError as exc:
        raise ValueError(f"{what} {spec!r}: {source}:{exc.lineno}: syntax error: {exc.msg}") from None
    bindings = top_level_bindings(tree)
    if "*" in bindings or "__getattr__" in bindings:
        return None  # names bound at import time: only importing it can tell
    first = attr_path.split(".")[0]
    if first not in bindings:
        raise ValueError(f"{what} {spec!r}: {module_name!r} ({source}) defines no top-level {first!r}")
    definition = bindings[first]
    if "." in attr_path or not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    if kwargs:
        _check_kwargs(f"{what} {spec!r}", definition, kwargs)
    return definition


def import_reference(spec: str, *, what: str = "reward function") -> Any:
    """The object `spec` names, imported now (its module's top-level code runs); ValueError naming it if not."""
    module_name, _, attr_path = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    return target


def find_module_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where `name` would be imported from, found without importing it or its parent packages (unlike
    importlib.util.find_spec, which imports the parents and so runs their __init__)."""
    spec = None
    search_path = None
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        spec = _find(".".join(parts[:depth]), search_path)
        if spec is None:
            return None
        if depth < len(parts):
            search_path = spec.submodule_search_locations
            if search_path is None:
                return None  # a module, not a package: it has no submodules
    return spec


def _find(fullname: str, search_path) -> importlib.machinery.ModuleSpec | None:
    module = sys.modules.get(fullname)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(fullname, list(search_path) if search_path is not None else None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


def _python_source(spec: importlib.machinery.ModuleSpec) -> Path | None:
    origin = spec.origin
    if origin and origin.endswith(".py") and Path(origin).is_file():
        return Path(origin)
    return None


def top_level_bindings(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module binds when it runs, with the statement that binds each ("*" for a star import). Compound
    statements at top level (if, try, with, for) count: `try: import fast_impl as score` still binds `score`."""
    bound: dict[str, ast.AST] = {}
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.With,
                               ast.AsyncWith)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            targets += [item.optional_vars for item in getattr(node, "items", [])]
            for target in filter(None, targets):
                bound.update((name.id, node) for name in ast.walk(target) if isinstance(name, ast.Name))
        if isinstance(node, (ast.If, ast.Try, ast.TryStar, ast.For, ast.AsyncFor, ast.While, ast.With,
                             ast.AsyncWith)):
            pending += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                        *(stmt for handler in getattr(node, "handlers", []) for stmt in handler.body)]
    return bound


def function_signature(function: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature a parsed `def` will have (defaults stand in as `...`: only whether there is one counts)."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    parameters = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_ONLY if i < len(arguments.posonlyargs)
                                    else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=... if i >= first_default else inspect.Parameter.empty)
                  for i, a in enumerate(positional)]
    if arguments.vararg is not None:
        parameters.append(inspect.Parameter(arguments.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    parameters += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                     default=inspect.Parameter.empty if default is None else ...)
                   for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg is not None:
        parameters.append(inspect.Parameter(arguments.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def _check_kwargs(named: str, function: ast.FunctionDef | ast.AsyncFunctionDef, kwargs: dict) -> None:

    arguments = function.args
    if is_verl_signature(function_signature(function)):
        problem = verl_kwargs_problem(kwargs)  # what resolve_reward_function's verl adapter will refuse
        if problem:
            raise ValueError(f"{named}: {problem}")
    if arguments.kwarg is not None:
        return  # **kwargs takes anything
    accepted = {a.arg for a in [*arguments.args, *arguments.kwonlyargs]}
    unexpected = sorted(set(kwargs) - accepted)
    if unexpected:
        raise ValueError(f"{named}: bad kwargs {sorted(kwargs)}: {function.name}() takes no parameter {unexpected[0]!r}")
