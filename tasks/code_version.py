"""The code version in cache keys: a hash of the source a task module can run, and nothing else.

It is the blake3 of every project module in the task module's import closure, found statically from the AST (so
imports inside functions count too). Editing the RL sampler then invalidates RL results only, never a reward
model's cached steps; editing anything a task can execute always invalidates its results.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import blake3

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("rollout_lib", "tasks")


def _module_path(name: str) -> Path | None:
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = PROJECT_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(path: Path, module: str) -> set[str]:
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    source = path.read_bytes()
    if path.name == "__init__.py" and b"pkgutil.iter_modules" in source:
        # A registry package that imports every module in it at run time (rollout_lib/algo, rollout_lib/sampling):
        # all of them are in its closure, though no import statement names them.
        names.update(f"{module}.{sibling.stem}" for sibling in path.parent.glob("*.py")
                     if sibling.name != "__init__.py")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def import_closure(module: str) -> list[Path]:
    """Source files of `module` and every project module it imports, transitively (parents included)."""
    seen: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py too.
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            path = _module_path(prefix)
            if path is None or prefix in seen:
                continue
            seen[prefix] = path
            pending.extend(_imported_names(path, prefix))
    return sorted(set(seen.values()))


@functools.cache
def code_version(module: str) -> str:
    digest = blake3.blake3()
    for path in import_closure(module):
        digest.update(str(path.relative_to(PROJECT_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
