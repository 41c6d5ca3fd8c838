"""The `rollout` command: train, dry-run, score with a checkpoint, export a checkpoint, manage the local stack."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time unless the user opts in
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # load reports are noise in training logs
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_lib")  # library log lines reach the flow run

ENTRY_POINTS = ("rm", "sft", "rl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run a training flow")
    train.add_argument("kind", choices=ENTRY_POINTS)
    train.add_argument("--config", required=True, help="TOML settings file")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="override one setting (repeatable), e.g. --set algorithm.rm.optimizer.lr=1e-4")
    train.add_argument("--dry-run", action="store_true",
                       help="validate settings, parse every dataset row, print the plan; load no model")

    score = commands.add_parser("score", help="score (prompt, response) JSONL rows with a reward-model checkpoint")
    score.add_argument("--checkpoint", required=True, help="checkpoint id (or a ref such as runs/NAME/latest)")
    score.add_argument("--data", required=True, help='JSONL with {"prompt", "response"} rows')
    score.add_argument("--store", default=".rollout/store", help="store root (fsspec URL)")
    score.add_argument("--max-seq-len", type=int, default=256)

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face directory")
    export.add_argument("--checkpoint", required=True)
    export.add_argument("--out", required=True)
    export.add_argument("--store", default=".rollout/store")

    stack = commands.add_parser("stack", help="the local Prefect stack deployments run on (docs/deployments.md)")
    stack.add_argument("action", choices=("start", "stop", "status", "env"))
    stack.add_argument("--port", type=int, help="start: server port (default 4200, else any free port)")
    stack.add_argument("--no-schedule", action="store_true", help="start: pause the nightly schedules")

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "score":
            return _score(args)
        if args.command == "export":
            return _export(args)
        if args.command == "stack":
            from flows.stack import run_cli

            return run_cli(args)
    except KnownError as exc:  # noqa: F821 - bound below, after the lazy imports
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _known_errors() -> tuple[type[BaseException], ...]:
    from rollout_lib.config import ConfigError
    from rollout_lib.data import DataError
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.store import StoreError

    return ConfigError, DataError, ModelLoadError, StoreError


KnownError = _known_errors()


def _config_class(kind: str):
    from rollout_lib.config import RlConfig, RmConfig, SftConfig

    return {"rm": RmConfig, "sft": SftConfig, "rl": RlConfig}[kind]


def _train(args) -> int:
    from rollout_lib.config import load_config
    from rollout_lib.plan import describe_plan

    config = load_config(_config_class(args.kind), args.config, args.overrides)
    plan = describe_plan(config)  # parses every dataset row and resolves the model reference: no model loads
    if args.dry_run:
        print(json.dumps(plan, indent=2))
        return 0
    from flows.local_server import use_prefect_api

    use_prefect_api()
    if args.kind == "sft":
        from flows.train_sft import train_sft as train_flow
    elif args.kind == "rl":
        from flows.train_rl import train_rl as train_flow
    else:
        from flows.train_rm import train_rm as train_flow

    state = train_flow(config=args.config, overrides=args.overrides, return_state=True)
    if state.is_failed() or state.is_crashed():
        exc = state.result(raise_on_failure=False)
        print(f"rollout: error: flow run failed: {_one_line(exc)}", file=sys.stderr)
        return 1
    result = state.result()
    print(json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "checkpoint": result["checkpoint"],
                      **{key: result[key] for key in ("eval_before", "eval_after", "reward_curve") if key in result}},
                     indent=2))
    print(f"final checkpoint: {result['checkpoint']}")
    return 0


def _one_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _score(args) -> int:
    from rollout_lib.data import load_responses
    from rollout_lib.rm.checkpoints import score_with_checkpoint
    from rollout_lib.store import ObjectStore

    store = ObjectStore(args.store)
    scored = score_with_checkpoint(store, args.checkpoint, load_responses(args.data), args.max_seq_len)
    for row in scored.to_pylist():
        print(json.dumps({"prompt": row["prompt"], "response": row["response"], "reward": row["reward"]}))
    return 0


def _export(args) -> int:
    from rollout_lib.trainer.checkpoint import resolve_checkpoint
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.checkpoint import export_hf_directory

    store = ObjectStore(args.store)
    print(export_hf_directory(store, resolve_checkpoint(store, args.checkpoint), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
