"""Algorithms from outside the package, found through Python entry points.

A distribution declares each algorithm as an entry point of the group "rollout.algorithms", named by its type and
pointing at its `Algorithm` subclass; in `pyproject.toml`:

    [project.entry-points."rollout.algorithms"]
    constant = "my_algos:Constant"

Loading one imports its module, which defines the class and so registers it (base.register), exactly like a
module of this package. The package loads every plugin when it is imported, before the config builds its `algo`
union, so `algo = { type = "constant" }` validates like a built-in type. A plugin that cannot load stops the import
with an error naming its entry point: a config naming its type would fail anyway, less clearly.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from rollout_lib.algo.base import ALGORITHMS, Algorithm

ENTRY_POINT_GROUP = "rollout.algorithms"


class AlgorithmPluginError(ImportError):
    """An entry point of ENTRY_POINT_GROUP that does not load a registered algorithm."""


def load_algorithm_plugins() -> list[str]:
    """Load every algorithm entry point; returns the type names they registered."""
    loaded = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        cls = _load(entry_point)
        loaded.append(cls.type_name)
    return loaded


def _load(entry_point: EntryPoint) -> type[Algorithm]:
    distribution = f" of {entry_point.dist.name}" if entry_point.dist is not None else ""
    named = (f"algorithm plugin {entry_point.name} = {entry_point.value!r} "
             f"(entry point{distribution}, group {ENTRY_POINT_GROUP!r})")
    try:
        cls = entry_point.load()
    except Exception as exc:  # whatever its module raises: the entry point is what the user can find and fix
        raise AlgorithmPluginError(f"{named}: cannot load: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Algorithm) and "type_name" in cls.__dict__):
        raise AlgorithmPluginError(f"{named}: does not name an Algorithm subclass with a type_name")
    if cls.type_name != entry_point.name:
        raise AlgorithmPluginError(f"{named}: the entry point's name must be the algorithm's type, "
                                   f"{cls.type_name!r}")
    if ALGORITHMS.get(cls.type_name) is not cls:
        raise AlgorithmPluginError(f"{named}: the algorithm did not register")
    return cls
