"""The library's floors (docs/architecture.md): every room of rollout_lib (a sub-package or top-level module) sits on
a floor, imports point down or sideways only, function-local imports included, and no rooms import each other in
a circle. A new room fails here until it is given a floor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rollout_lib"

# Lowest first; docs/architecture.md says what belongs where.
FLOORS = {
    0: {"__init__", "wire", "store", "store_gc", "paths", "errors", "settings_base", "determinism", "hardware",
        "checkpoint", "processes", "step_events", "digests", "adapters"},
    1: {"model", "packing", "losses", "rl_losses", "data"},
    2: {"algo", "envs", "sampling", "reward", "serving"},
    3: {"config"},
    4: {"identity", "trainer", "sft", "rm", "rl", "runlog", "plan"},
}
FLOOR_OF = {room: floor for floor, rooms in FLOORS.items() for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rollout_lib" and len(parts) > 1 else None


def room_imports() -> dict[str, dict[str, list[str]]]:
    """room -> imported room -> where ("file:line"), for every import statement of the package."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = _room(module) or "__init__"
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        found.setdefault(source, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                targets = [".".join(part for part in (base, node.module or "") if part)]
            else:
                continue
            for target in targets:
                room = _room(target)
                if room is not None and room != source:
                    found[source].setdefault(room, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_room_has_a_floor():
    unplaced = sorted(set(room_imports()) - set(FLOOR_OF))
    assert not unplaced, f"rooms without a floor (add them to FLOORS and docs/architecture.md): {unplaced}"


def test_imports_point_down_or_sideways():
    upward = [f"{where}: {source} (floor {FLOOR_OF[source]}) imports {target} (floor {FLOOR_OF[target]})"
              for source, targets in room_imports().items() if source in FLOOR_OF
              for target, places in targets.items() if target in FLOOR_OF and FLOOR_OF[target] > FLOOR_OF[source]
              for where in places]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_rooms_import_each_other_in_a_circle():
    graph = {source: set(targets) for source, targets in room_imports().items()}
    done: set[str] = set()

    def visit(room: str, path: list[str]) -> list[str] | None:
        if room in path:
            return path[path.index(room):] + [room]
        if room in done:
            return None
        for target in sorted(graph.get(room, ())):
            circle = visit(target, [*path, room])
            if circle:
                return circle
        done.add(room)
        return None

    for room in sorted(graph):
        circle = visit(room, [])
        assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_check_sees_function_local_imports():
    """The control: a function-local import counts (circles hid behind them before)."""
    assert "rollout_lib/rl/score.py" in " ".join(room_imports()["rl"]["hardware"])
