"""The checkpoint id each shipped tiny config trains to, for comparing two versions of rollout (issue 42: a
refactor must leave every one of them identical).

Trains each config for `--max-steps` steps through the CLI (`rollout train <entry> --config ... --store <tmp>`, a
fresh store each, in a process started in `--repo`, so an older checkout can be measured with this script), and
prints one line per config, `<config> <checkpoint id>`, or why it has none.

    .venv/bin/python scripts/checkpoint_ids.py [--repo DIR] [--max-steps 2] [CONFIG ...]
    # two versions side by side: a worktree of the old commit, then diff the outputs
    git worktree add --detach /tmp/old <commit> && .venv/bin/python scripts/checkpoint_ids.py --repo /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["configs/rm-tiny.toml", "configs/sft-tiny.toml", "configs/rl-tiny.toml", "configs/sft-teacher-tiny.toml",
        "configs/sft-tools-tiny.toml", "configs/rl-agent-tiny.toml"]


def checkpoint_of(repo: Path, config: str, max_steps: int) -> str:
    entry = Path(config).name.split("-")[0]  # the shipped configs are named by entry point
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]),
               "HF_HUB_OFFLINE": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run([sys.executable, "-m", "rollout_cli", "train", entry, "--config", config,
                               "--store", store, "--max-steps", str(max_steps)],
                              cwd=repo, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
        return json.loads(done.stdout)["checkpoint"]  # what `rollout train` prints on stdout: its result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=TINY)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to train with [this one]")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()
    for config in args.configs:
        if not (args.repo / config).is_file():
            print(f"{config} absent in {args.repo}", flush=True)
            continue
        print(f"{config} {checkpoint_of(args.repo, config, args.max_steps)}", flush=True)


if __name__ == "__main__":
    main()
