"""The house (docs/architecture.md): rollout_cli > flows > tasks > rollout_lib, imports pointing down only. Every
room of rollout_lib (a sub-package or top-level module) sits on a floor, imports point down or sideways only, no
rooms import each other in a circle, no files import each other in a circle inside a room (flows/, tasks/ and
rollout_cli/ are one room each), and docs/architecture.md names every module. Function-local imports count.
Each check is a function of a checkout's root, so the tests below also run it on a small broken house."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("rollout_lib", "tasks", "flows", "rollout_cli")  # lowest first: each imports only the ones before it
FORBIDDEN = {"rollout_lib": ("prefect",)}  # the library runs and tests without Prefect

# Lowest first; docs/architecture.md says what belongs where.
FLOORS = {
    0: {"__init__", "wire", "store", "store_tensors", "store_errors", "store_gc", "paths", "errors", "settings_base",
        "determinism", "hardware", "gpu_env", "checkpoint", "processes", "step_events", "adapters"},
    1: {"model", "packing", "losses", "rl_losses", "data"},
    2: {"algo", "envs", "sampling", "reward", "serving"},
    3: {"config"},
    4: {"identity", "trainer", "sft", "rm", "rl", "runlog", "plan", "plan_checks"},
}
# Every ingredient of a cache key lives in identity/ (docs/architecture.md). A module elsewhere that computes a digest
# says here why it never enters a key; any other one fails test_digests_are_computed_in_identity.
DIGEST_LIBRARIES = ("blake3", "hashlib")
DIGESTS_OUTSIDE_IDENTITY = {
    "rollout_lib.store": "content ids: an object's name, which a key holds as the id of an input",
    "rollout_lib.store_tensors": "a streamed read checks the object's bytes against its id (store.py's content ids)",
    "rollout_lib.model.loading": "a model's content digest: model loading checks an adapter's base by it (the one "
                                 "ingredient below identity/, docs/architecture.md)",
    "rollout_lib.determinism": "seeds drawn from content",
    "rollout_lib.trainer.segment": "the name of a chain-index ref, a lookup of finished steps, never a key",
    "rollout_lib.rl.behaviour": "which behaviour-logprob chunk computed elsewhere is adopted",
    "rollout_lib.reward.loops": "an in-process lookup of a run's reward loops",
    "rollout_lib.runlog.trackers.build": "a tracker's run id",
    "rollout_lib.serving.engine": "a directory name",
    "flows.common": "the name of the result-storage block",
    "tasks.common": "the cache key itself, composed from identity/'s ingredients",
}
FLOOR_OF = {room: floor for floor, rooms in FLOORS.items() for room in rooms}

Graph = dict[str, dict[str, list[str]]]  # module -> imported module -> where ("file:line")


def modules(root: Path) -> dict[str, Path]:
    """Every module of the four layers, by dotted name (a package by its own name)."""
    return {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
            for layer in LAYERS for path in sorted((root / layer).rglob("*.py"))}


def module_imports(root: Path) -> Graph:
    """Every import statement of the four layers, function-local ones included. A target inside the house is the
    module it names (`from rollout_lib import rl` names rollout_lib.rl); one outside keeps its dotted name."""
    known = modules(root)

    def resolve(name: str) -> str:
        inside = name
        while inside and inside not in known:
            inside = inside.rpartition(".")[0]
        return inside or name

    found: Graph = {}
    for module, path in known.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        found[module] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                source = ".".join(part for part in (base, node.module or "") if part)
                targets = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in {resolve(target) for target in targets} - {module}:
                found[module].setdefault(target, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def room(module: str) -> str:
    """rollout_lib's rooms by their name (the package itself is `__init__`); flows, tasks, rollout_cli whole."""
    parts = module.split(".")
    if parts[0] != "rollout_lib":
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def room_imports(root: Path = ROOT) -> Graph:
    """room of rollout_lib -> imported room -> where."""
    found: Graph = {}
    for module, targets in module_imports(root).items():
        if module.split(".")[0] == "rollout_lib":
            into = found.setdefault(room(module), {})
            for target, places in targets.items():
                if target.split(".")[0] == "rollout_lib" and room(target) != room(module):
                    into.setdefault(room(target), []).extend(places)
    return found


def find_circle(graph: Graph) -> list[str]:
    """One circle of the graph as its edges ("a -> b at file:line"), or [] if there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            circle = path[path.index(node):] + [node]
            return [f"{a} -> {b} at {graph[a][b][0]}" for a, b in zip(circle, circle[1:])]
        if node in done:
            return []
        for target in sorted(graph.get(node, ())):
            circle = visit(target, [*path, node])
            if circle:
                return circle
        done.add(node)
        return []

    for node in sorted(graph):
        circle = visit(node, [])
        if circle:
            return circle
    return []


def upward_room_imports(root: Path) -> list[str]:
    return [f"{where}: {source} (floor {FLOOR_OF[source]}) imports {target} (floor {FLOOR_OF[target]}); move the "
            f"piece both need down to a floor {source} may import"
            for source, targets in room_imports(root).items() if source in FLOOR_OF
            for target, places in targets.items() if target in FLOOR_OF and FLOOR_OF[target] > FLOOR_OF[source]
            for where in places]


def layer_violations(root: Path) -> list[str]:
    """Imports of a higher layer, or of a package the layer must not import (prefect_ray is Prefect too)."""
    found = []
    for module, targets in module_imports(root).items():
        layer = module.split(".")[0]
        below = f"only {', '.join(LAYERS[:LAYERS.index(layer)])}" if LAYERS.index(layer) else "no other layer"
        for target, places in targets.items():
            top = target.split(".")[0]
            upward = top in LAYERS and LAYERS.index(top) > LAYERS.index(layer)
            forbidden = any(top == name or top.startswith(f"{name}_") for name in FORBIDDEN.get(layer, ()))
            if upward or forbidden:
                found += [f"{where}: {layer}/ imports {target}, but it may import {below}"
                          f"{', and never ' + top if forbidden else ''}: move the shared piece down a layer, or the "
                          f"import up" for where in places]
    return found


def file_circle_in_a_room(root: Path) -> list[str]:
    """A circle of files inside one room: module imports between files of the same room only."""
    graph = {module: {target: places for target, places in targets.items()
                      if target.split(".")[0] in LAYERS and room(target) == room(module)}
             for module, targets in module_imports(root).items()}
    return find_circle(graph)


def digests_outside_identity(root: Path) -> list[str]:
    """Modules outside rollout_lib/identity/ that import a digest library and are not in DIGESTS_OUTSIDE_IDENTITY."""
    return [f"{places[0]}: {module} computes a digest ({target}) outside rollout_lib/identity/; move the key "
            f"ingredient there, or say in DIGESTS_OUTSIDE_IDENTITY why it never enters a cache key"
            for module, targets in module_imports(root).items()
            if not module.startswith("rollout_lib.identity") and module not in DIGESTS_OUTSIDE_IDENTITY
            for target, places in sorted(targets.items()) if target.split(".")[0] in DIGEST_LIBRARIES]


def undocumented_modules(root: Path, doc: str) -> list[str]:
    """rollout_lib modules the doc does not name: a module is named by its path below rollout_lib/ (`rl/pack.py`,
    `rl/pack`, a sub-package's `trackers/build`), a package by `rl/`, a top-level module by `wire.py`, or any
    module by its bare name on its room's line in the floor plan (`rl/ prompts · sample · ...`)."""
    plan = doc.split("```")[1] if doc.count("```") >= 2 else ""
    markers = list(re.finditer(r"\b([a-z_]+)/ ", plan))
    sections = {marker.group(1): plan[marker.end(): after.start() if after else len(plan)]
                for marker, after in zip(markers, [*markers[1:], None])}
    missing = []
    for path in sorted((root / "rollout_lib").rglob("*.py")):
        parts = path.relative_to(root / "rollout_lib").with_suffix("").parts
        if parts == ("__init__",):
            continue
        if parts[-1] == "__init__":
            names = ["/".join(parts[i:-1]) + "/" for i in range(len(parts) - 1)]
        else:
            names = [f"{'/'.join(parts[i:])}{suffix}" for i in range(len(parts)) for suffix in (".py", "")]
            # `base.py` alone is ambiguous (four rooms have one), `wire` alone is a word
            names = [name for name in names if "/" in name or (len(parts) == 1 and name.endswith(".py"))]
        named = any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", doc) for name in names)
        in_room_line = len(parts) > 1 and re.search(rf"\b{parts[-1]}\b", sections.get(parts[0], ""))
        if not (named or in_room_line):
            missing.append(f"{path.relative_to(root)}:1: not named in docs/architecture.md; add it to its room's "
                           f"line (or a line of its own) saying what it does")
    return missing


def test_every_room_has_a_floor():
    unplaced = sorted(set(room_imports()) - set(FLOOR_OF))
    assert not unplaced, f"rooms without a floor (add them to FLOORS and docs/architecture.md): {unplaced}"


def test_imports_point_down_or_sideways():
    upward = upward_room_imports(ROOT)
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_rooms_import_each_other_in_a_circle():
    circle = find_circle(room_imports())
    assert not circle, "rooms import each other in a circle; move the shared piece down a floor:\n" + "\n".join(circle)


def test_no_files_import_each_other_in_a_circle_inside_a_room():
    circle = file_circle_in_a_room(ROOT)
    assert not circle, ("files import each other in a circle; move the piece they share into a module of its own "
                        "(or down a floor):\n" + "\n".join(circle))


def test_layers_point_down():
    violations = layer_violations(ROOT)
    assert not violations, "imports across the layers rollout_cli > flows > tasks > rollout_lib:\n" + "\n".join(
        violations)


def test_the_doc_names_every_module():
    missing = undocumented_modules(ROOT, (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert not missing, "\n".join(missing)


def test_digests_are_computed_in_identity():
    found = digests_outside_identity(ROOT)
    assert not found, "\n".join(found)
    stale = sorted(set(DIGESTS_OUTSIDE_IDENTITY) - {module for module, targets in module_imports(ROOT).items()
                                                    if any(t.split(".")[0] in DIGEST_LIBRARIES for t in targets)})
    assert not stale, f"DIGESTS_OUTSIDE_IDENTITY names modules that compute no digest: {stale}"


def test_the_check_sees_function_local_imports():
    """The control: a function-local import counts (circles hid behind them before)."""
    assert "rollout_lib/rl/score.py" in " ".join(room_imports()["rl"]["hardware"])


def _house(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_the_checks_fail_on_a_broken_house(tmp_path):
    """Each check on a small house built to break it: the checks can fail, and name the file and line."""
    root = _house(tmp_path, {
        "rollout_lib/__init__.py": "",
        "rollout_lib/wire.py": "def f():\n    from rollout_lib import model\n",  # floor 0 reaching floor 1
        "rollout_lib/model/__init__.py": "",
        "rollout_lib/model/a.py": "from rollout_lib.model import b\n",
        "rollout_lib/model/b.py": "from .a import x\nfrom rollout_lib.wire import f\n",  # a <-> b; model <-> wire
        "rollout_lib/model/c.py": "import prefect_ray\n",
        "rollout_lib/identity/__init__.py": "import blake3\n",  # in identity/: fine
        "tasks/keys.py": "def key():\n    import blake3\n",  # a digest outside identity/, unexplained
        "tasks/__init__.py": "",
        "tasks/t.py": "from flows.f import g\n",
        "flows/__init__.py": "",
        "flows/f.py": "import rollout_cli.m\n",
        "rollout_cli/__init__.py": "",
        "rollout_cli/m.py": "from tasks import t\nfrom rollout_lib import wire\n",  # downward: fine
    })
    assert upward_room_imports(root) == [
        "rollout_lib/wire.py:2: wire (floor 0) imports model (floor 1); move the piece both need down to a floor "
        "wire may import"]
    assert find_circle(room_imports(root)) == ["model -> wire at rollout_lib/model/b.py:2",
                                               "wire -> model at rollout_lib/wire.py:2"]
    assert file_circle_in_a_room(root) == ["rollout_lib.model.a -> rollout_lib.model.b at rollout_lib/model/a.py:1",
                                           "rollout_lib.model.b -> rollout_lib.model.a at rollout_lib/model/b.py:1"]
    assert [line.split(" outside")[0] for line in digests_outside_identity(root)] == [
        "tasks/keys.py:2: tasks.keys computes a digest (blake3)"]
    assert [line.split(", but")[0] for line in layer_violations(root)] == [
        "rollout_lib/model/c.py:1: rollout_lib/ imports prefect_ray", "tasks/t.py:1: tasks/ imports flows.f",
        "flows/f.py:1: flows/ imports rollout_cli.m"]
    doc = "```\n 4 machinery identity/ keys\n 1 basics   model/ a · the b module\n 0 ground   wire.py\n```\n"
    assert [line.split(":")[0] for line in undocumented_modules(root, doc)] == ["rollout_lib/model/c.py"]
    assert undocumented_modules(root, doc + "c.py") and not undocumented_modules(root, doc + "rollout_lib/model/c.py")
    missing = undocumented_modules(root, doc.replace("wire.py", "the wire") + "model/c.py")
    assert [line.split(":")[0] for line in missing] == ["rollout_lib/wire.py"]


def test_a_circle_of_files_spans_flows_tasks_and_rollout_cli(tmp_path):
    root = _house(tmp_path, {"rollout_lib/__init__.py": "", "rollout_cli/main.py": "from rollout_cli.runs import r\n",
                             "rollout_cli/runs.py": "def r():\n    from rollout_cli.main import store_url\n"})
    assert file_circle_in_a_room(root)[1] == "rollout_cli.runs -> rollout_cli.main at rollout_cli/runs.py:2"
