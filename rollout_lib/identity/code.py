"""The code version in cache keys: a hash of the source a task module can run, and nothing else.

It is the blake3 of every project module in the task module's import closure, found statically from the AST (so
imports inside functions count too). A name imported from a package that only re-exports it leads to the module
that defines it, not to everything the package's __init__ imports. Editing the RL sampler or the RL settings then
invalidates RL results only, never a reward model's cached steps; editing anything a task can execute always
invalidates its results, and so does upgrading a library that decides numerics (NUMERIC_LIBRARIES). Code outside
the project (a user's reward functions, algorithm plugins, custom advantage functions) is keyed by the task that
calls it (tasks/rl.py: the score key has each reward module's source digest, the advantages key each outside
algorithm module's).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import blake3

from rollout_lib.paths import PROJECT_ROOT
from rollout_lib.store import canonical_json

PROJECT_PACKAGES = ("rollout_lib", "tasks")


def _module_path(name: str) -> Path | None:
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = PROJECT_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _import_target(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _is_package(name: str) -> bool:
    path = _module_path(name)
    return path is not None and path.name == "__init__.py"


def _from_import(target: str, name: str) -> tuple:
    """What `from target import name` can run: a submodule, a name re-exported by a package, or a module."""
    if _module_path(f"{target}.{name}") is not None:
        return ("module", f"{target}.{name}")
    if _is_package(target):
        return ("name", target, name)
    return ("module", target)


def _dependencies(path: Path, module: str) -> set[tuple]:
    """The modules (or names re-exported by packages) whose code `module` can run."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    source = path.read_bytes()
    found: set[tuple] = set()
    if path.name == "__init__.py" and b"pkgutil.iter_modules" in source:
        # A registry package that imports every module in it at run time (rollout_lib/algo, rollout_lib/sampling):
        # all of them are in its closure, though no import statement names them.
        found.update(("module", f"{module}.{sibling.stem}") for sibling in path.parent.glob("*.py")
                     if sibling.name != "__init__.py")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(("module", alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
            if any(alias.name == "*" for alias in node.names):
                found.add(("module", target))
            else:
                found.update(_from_import(target, alias.name) for alias in node.names)
    return found


def _reexport_source(package: str, name: str) -> tuple:
    """Where package/__init__.py gets `name` from; the whole package when it defines the name itself."""
    path = _module_path(package)
    assert path is not None
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    return _from_import(_import_target(node, package), alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name:
                    return ("module", alias.name)
    return ("module", package)


def import_closure(module: str) -> list[Path]:
    """Source files of `module` and of every project module whose code it can run, transitively.

    A package's __init__.py that only re-exports (`from rollout_lib.config import RmConfig`) leads to the module
    the name comes from, not to everything the __init__ imports: importing it does execute its other imports
    (config/rl.py, say), but an RM task never calls into them, so editing them must not invalidate RM results.
    The __init__ files on the way are in the closure themselves (a change to one counts)."""
    files: dict[str, Path] = {}
    done: set[tuple] = set()
    pending: list[tuple] = [("module", module)]
    while pending:
        item = pending.pop()
        if item in done:
            continue
        done.add(item)
        if item[0] == "name":
            pending.append(_reexport_source(item[1], item[2]))
            continue
        name = item[1]
        path = _module_path(name)
        if path is None:
            continue
        parts = name.split(".")
        for depth in range(1, len(parts)):  # importing a.b.c runs a/__init__.py and a/b/__init__.py
            parent = _module_path(".".join(parts[:depth]))
            if parent is not None:
                files[".".join(parts[:depth])] = parent
        files[name] = path
        pending.extend(_dependencies(path, name))
    return sorted(set(files.values()))


# Libraries whose numerics decide a result (kernels, tokenization, serialisation): an upgrade invalidates caches.
NUMERIC_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "pyarrow", "numpy")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return {name: installed(name) for name in NUMERIC_LIBRARIES}


@functools.cache
def code_version(module: str) -> str:
    """blake3 of the module's import closure (paths and sources) and of the numeric libraries' versions."""
    digest = blake3.blake3(canonical_json(library_versions()))
    for path in import_closure(module):
        digest.update(str(path.relative_to(PROJECT_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
