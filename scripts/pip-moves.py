"""Read a `pip install --dry-run --report` file and print each already-installed package it would move
(`name installed -> new`), one a line; exit 1 when there is any. scripts/setup.sh installs an optional extra only
when this prints nothing, so an extra never upgrades or downgrades what the project already runs on."""

import importlib.metadata
import json
import sys

moves = []
for item in json.load(open(sys.argv[1], encoding="utf-8"))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        continue
    if installed != version:
        moves.append(f"{name} {installed} -> {version}")
print("\n".join(moves))
sys.exit(1 if moves else 0)
