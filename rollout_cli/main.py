"""The `rollout` command: train (or dry-run) a flow, show settings (`config`, rollout_cli/config_cmd.py), score with
a checkpoint, export a checkpoint, collect a store's garbage, manage the local Prefect stack, and serve models (vLLM).

Modules that import torch, transformers or Prefect are imported inside the commands that need them: `--help` is
instant, and `--dry-run` loads no model. Known errors (bad settings, a bad data row, a model that does not load, a
store problem, a stack or a served model that does not start) print `rollout: error: <message>` and exit 2 (one
line, followed by the end of the server's log when a served model fails to start).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import click

from rollout_cli import stack
from rollout_cli.config_cmd import ENTRY_POINTS, config_group, load_settings
from rollout_cli.follow import follow
from rollout_cli.local_server import use_prefect_api
from rollout_cli.options import STORE_OPTION_DEFAULT, UsageLine
from rollout_cli.prefect_settings import follow_environment
from rollout_cli.runs import runs_group

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time unless the user opts in
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # load reports are noise in training logs
# transformers' tqdm bars (Loading weights, Writing model shards) would tear through rollout's own progress bar
# (rich, not tqdm: untouched); read when transformers is imported, here and in every process the CLI starts.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_lib")  # library log lines reach the flow run


def run() -> None:
    """The `rollout` command as a process (`python -m rollout_cli`, the console script): `main`, then the process
    ends as the interpreter's exit would, but for its last part. Non-daemon threads are waited for and the atexit
    handlers run (logging's shutdown; Prefect's flush of the flow's logs and events to its server), output is
    flushed; what is skipped is the interpreter's teardown of every module object (torch's, transformers', Prefect's:
    ~1.8 million objects, 1-3 s of every command on 2 cores, docs/hardware.md), which frees nothing the OS would not.
    An uncaught error still ends the process the interpreter's way (its traceback, exit code 1)."""
    import atexit
    import threading

    follow_environment()  # a process that imported Prefect under another environment: tests/zygote.py's children
    code = main()
    threading._shutdown()  # the interpreter's own first step at exit: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run `rollout` with `argv` (default: the command line); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # obj: the command line, which `train` names as the command that resumes a run
        return rollout.main(args=argv, prog_name="rollout", standalone_mode=False, obj={"argv": argv}) or 0
    except click.ClickException as exc:  # a usage error: click's message
        exc.show()
        return exc.exit_code
    except click.Abort:  # Ctrl-C
        print("Aborted!", file=sys.stderr)
        return 130
    except Exception as exc:
        if not isinstance(exc, _known_errors()):
            raise
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2


def _known_errors() -> tuple[type[Exception], ...]:
    from rollout_lib.config import ConfigError
    from rollout_lib.data import DataError
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.serving.client import ServingError
    from rollout_lib.serving.engine import EngineError
    from rollout_lib.store import StoreError

    return ConfigError, DataError, ModelLoadError, StoreError, EngineError, ServingError, stack.StackError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rollout", message="%(prog)s %(version)s")  # the installed distribution's
def rollout() -> None:
    """Post-training of language models as Prefect flows."""


# --- train ----------------------------------------------------------------------------------------------------


@rollout.command()
@click.argument("entry_point", metavar="{rm|sft|rl|rlhf}", type=click.Choice(ENTRY_POINTS))
@click.option("--config", "config_path", required=True, metavar="PATH", help="TOML settings file")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="override one setting (repeatable), e.g. --set algorithm.rm.optimizer.lr=1e-4")
@click.option("--max-steps", type=int, metavar="N",
              help="--set algorithm.<ENTRY_POINT>.budget.max_steps=N (rm, sft, rl: rlhf's stages have their own)")
@click.option("--name", "run_name", metavar="NAME", help="--set run.name=NAME")
@click.option("--store", "store_url", metavar="URL", help="--set run.store=URL (fsspec URL)")
@click.option("--nproc", type=click.IntRange(min=1), metavar="N",
              help="--set algorithm.<ENTRY_POINT>.hardware.nproc=N: train data-parallel in N processes (torchrun; "
                   "sft, rm and rl, docs/hardware.md)")
@click.option("--dry-run", is_flag=True,
              help="validate settings, parse every dataset row, print the plan; load no model")
@click.option("--quiet", is_flag=True, help="no progress bar and no summary on stderr (the JSON result stays)")
@click.option("--verbose", is_flag=True, help="print the tracebacks of a failing run here (else: one line naming "
                                              "where they are)")
def train(entry_point: str, config_path: str, overrides: tuple[str, ...], max_steps: int | None,
          run_name: str | None, store_url: str | None, nproc: int | None, dry_run: bool, quiet: bool,
          verbose: bool) -> int:
    """Run a training flow (rlhf: sft -> rm -> rl as one flow of three subflows, docs/rlhf.md).

    --max-steps, --name, --store and --nproc are the --set overrides they name, applied after the --set ones.
    A progress bar per run (rlhf: per stage) and a summary go to stderr, unless --quiet; stdout gets the result as
    one JSON document. A failing run ends with one line naming the failure and its flow run's page (--verbose:
    with the tracebacks above it).

    It runs on the Prefect server of PREFECT_API_URL if set, else on the project-local one (started on first use).
    """
    from rollout_lib.paths import use_home_of_config
    from rollout_lib.plan import describe_plan

    # The config's project's home (its server, its default store), whichever directory this was typed in.
    use_home_of_config(config_path)
    overrides = (*overrides, *_shortcut_overrides(entry_point, max_steps, run_name, store_url, nproc))
    _, config = load_settings(entry_point, config_path, list(overrides), "rollout train")
    from flows.api_watch import cli_rerun, lost_after_s, watch

    lost_after_s()  # a bad ROLLOUT_SERVER_LOST_AFTER_S is a settings error, found before anything starts
    plan = describe_plan(config)  # parses every dataset row and resolves the model reference: no model loads
    if dry_run:
        print(json.dumps(plan, indent=2))
        return 0

    if entry_point != "rlhf":  # rlhf's stages are named by their training identity: each claims its own name
        _claim_run_name(config)  # a name that holds another training fails here, in one line, before anything starts
    own_server = not os.environ.get("PREFECT_API_URL")
    api_url = use_prefect_api()  # before the flow module imports Prefect, which reads its settings once
    if entry_point == "sft":
        from flows.train_sft import train_sft as train_flow
    elif entry_point == "rl":
        from flows.train_rl import train_rl as train_flow
    elif entry_point == "rlhf":
        from flows.rlhf import rlhf as train_flow
    else:
        from flows.train_rm import train_rm as train_flow
    from rollout_cli.progress import (TrainingProgress, flow_run_url, routine_lines_hidden, stdout_to_stderr,
                                      tracebacks_hidden)

    watching = nullcontext() if quiet else TrainingProgress(entry_point, config)
    # The server going away ends the run in one line naming the command that resumes it (flows/api_watch.py).
    server = watch(api_url, cli_rerun(click.get_current_context().obj["argv"], own_server),
                   before_exit=None if quiet else watching.progress.stop)
    with stdout_to_stderr(), nullcontext() if verbose else tracebacks_hidden(), \
            nullcontext() if verbose else routine_lines_hidden(), watching:
        try:
            state = train_flow(config=config_path, overrides=list(overrides), return_state=True)
        finally:
            server.settle()  # a failure the lost server caused ends in that line, not in a traceback
    code = _report(entry_point, state, flow_run_url(api_url, str(state.state_details.flow_run_id)),
                   None if quiet else watching.observed(), verbose)
    server.run_ended(code)
    return code


def _report(entry_point: str, state, url: str, observed: dict | None, verbose: bool) -> int:
    """The run's end: its result as one JSON document on stdout and the summary on stderr (none when `observed` is
    None: --quiet), or one line naming the failure and where its tracebacks are; the exit code."""
    from rollout_cli.progress import print_summary

    if state.is_failed() or state.is_crashed():
        failure = _first_line(state.result(raise_on_failure=False))
        where = f"logs: {url}" if verbose else f"logs and tracebacks: {url}, or rerun with --verbose"
        print(f"rollout: error: flow run failed: {failure} ({where})", file=sys.stderr)
        return 1
    result = state.result()
    shown = ("eval_before", "eval_after", "reward_curve", "eval_curves", "stages")
    print(json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "checkpoint": result["checkpoint"],
                      **{key: result[key] for key in shown if key in result}}, indent=2))
    if observed is not None:
        sys.stdout.flush()  # the JSON first where both streams are one terminal
        print_summary(entry_point, result, url, observed)
    return 0


def _shortcut_overrides(entry_point: str, max_steps: int | None, run_name: str | None,
                        store_url: str | None, nproc: int | None = None) -> list[str]:
    """The `--set` overrides that --max-steps, --name, --store and --nproc stand for: validated, hashed and passed to
    the flow as if typed with --set (strings quoted, so a name such as 123 stays a string)."""
    import tomli_w

    if max_steps is not None and entry_point == "rlhf":
        raise click.UsageError(
            "--max-steps: rlhf trains three stages, each to its own budget; set one in a stage's overrides, e.g. "
            '[sft] overrides = ["algorithm.sft.budget.max_steps=4"] in the rlhf config', click.get_current_context())
    if nproc is not None and entry_point == "rlhf":
        raise click.UsageError(
            "--nproc: rlhf trains three stages; set one in a stage's overrides, e.g. "
            '[sft] overrides = ["algorithm.sft.hardware.nproc=2"] in the rlhf config', click.get_current_context())
    shortcuts = [] if max_steps is None else [f"algorithm.{entry_point}.budget.max_steps={max_steps}"]
    if nproc is not None:
        shortcuts.append(f"algorithm.{entry_point}.hardware.nproc={nproc}")
    for key, text in (("run.name", run_name), ("run.store", store_url)):
        if text is not None:
            shortcuts.append(f"{key}={tomli_w.dumps({'v': text}).removeprefix('v = ').rstrip()}")
    return shortcuts


def _claim_run_name(config) -> None:
    from rollout_lib.identity.claims import claim_run_name

    claim_run_name(config)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# --- checkpoints ----------------------------------------------------------------------------------------------


@rollout.command()
@click.option("--checkpoint", required=True, help="checkpoint id (or a ref such as runs/NAME/latest)")
@click.option("--data", "data_path", required=True, metavar="PATH", help='JSONL with {"prompt", "response"} rows')
@click.option("--store", "store_url", **STORE_OPTION_DEFAULT, help="store root (fsspec URL)")
@click.option("--max-seq-len", type=int, default=256, show_default=True)
def score(checkpoint: str, data_path: str, store_url: str, max_seq_len: int) -> None:
    """Score (prompt, response) rows with a reward model."""
    from rollout_lib.data import load_responses
    from rollout_lib.rm.checkpoints import score_with_checkpoint
    from rollout_lib.store import ObjectStore

    scored = score_with_checkpoint(ObjectStore(store_url), checkpoint, load_responses(data_path), max_seq_len)
    for row in scored.to_pylist():
        print(json.dumps({"prompt": row["prompt"], "response": row["response"], "reward": row["reward"]}))


@rollout.command()
@click.option("--checkpoint", required=True, help="checkpoint id (or a ref such as runs/NAME/latest)")
@click.option("--out", "out_dir", required=True, metavar="DIR", help="directory to write")
@click.option("--store", "store_url", **STORE_OPTION_DEFAULT, help="store root (fsspec URL)")
@click.option("--merged", is_flag=True, help="a LoRA checkpoint: its base with the adapter merged in, as a plain "
                                             "model directory (default: a PEFT adapter directory)")
def export(checkpoint: str, out_dir: str, store_url: str, merged: bool) -> None:
    """Write a checkpoint as a Hugging Face directory (a LoRA checkpoint: a PEFT adapter directory, or with
    --merged its merged weights)."""
    from rollout_lib.store import ObjectStore
    from rollout_lib.checkpoint import (export_adapter_directory, export_hf_directory, is_adapter_checkpoint,
                                        read_manifest, resolve_checkpoint)
    from rollout_lib.model.loading import export_merged_directory

    store = ObjectStore(store_url)
    checkpoint_id = resolve_checkpoint(store, checkpoint)
    if not is_adapter_checkpoint(read_manifest(store, checkpoint_id)):
        print(export_hf_directory(store, checkpoint_id, out_dir))  # full weights: merged already
    elif merged:
        print(export_merged_directory(store, checkpoint_id, out_dir))
    else:
        print(export_adapter_directory(store, checkpoint_id, out_dir))


# --- store ----------------------------------------------------------------------------------------------------


@rollout.command()
@click.option("--store", "store_url", **STORE_OPTION_DEFAULT, help="store root (fsspec URL)")
@click.option("--dry-run", is_flag=True, help="print what would be deleted and its bytes; delete nothing")
@click.option("--grace-hours", type=click.FloatRange(min=0), default=24.0, show_default=True, metavar="N",
              help="keep objects written in the last N hours (a running flow sets its ref only at its end)")
def gc(store_url: str, dry_run: bool, grace_hours: float) -> None:
    """Delete objects no ref reaches, and the cached task results that name them.

    Kept: everything a ref (runs/NAME/latest, ...) reaches through checkpoint manifests and other JSON objects, and
    everything written within the grace period. Run it between runs: a run resumed from cache entries older than
    the grace period may lose objects no ref reached (its rerun recomputes them).
    """
    from rollout_lib.store import ObjectStore
    from rollout_lib.store_gc import collect_garbage, plan_gc

    store = ObjectStore(store_url)
    plan = plan_gc(store, grace_seconds=grace_hours * 3600)
    if dry_run:
        for stored in plan.files:
            print(f"would delete {stored.name} ({stored.size} bytes)")
    else:
        collect_garbage(store, plan)
    print(f"{'would delete' if dry_run else 'deleted'} {len(plan.objects)} objects, {len(plan.results)} cached task "
          f"results, {len(plan.index_refs)} chain index entries, {len(plan.staging)} staging files: {plan.bytes} bytes "
          f"({_human_bytes(plan.bytes)}); kept "
          f"{plan.kept_objects} objects ({plan.kept_objects - plan.kept_for_grace} reached from {plan.refs} refs, "
          f"{plan.kept_for_grace} more written in the last {grace_hours:g} h)")


def _human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


# --- stack ----------------------------------------------------------------------------------------------------


@rollout.group("stack")
def stack_group() -> None:
    """The local Prefect stack deployments run on (docs/deployments.md)."""
    from rollout_cli.local_server import prefect_home

    # Prefect creates its home when imported: without PREFECT_HOME that would be ~/.prefect, outside the project.
    if "PREFECT_HOME" not in os.environ:
        os.environ["PREFECT_HOME"] = str(prefect_home())
        follow_environment()


@stack_group.command("start")
@click.option("--port", type=int, help="server port (default 4200, else any free port)")
@click.option("--no-schedule", is_flag=True, help="pause the nightly schedules")
def stack_start(port: int | None, no_schedule: bool) -> None:
    """Start server, work pool, deployments, worker."""
    record = stack.start(port=port, schedules=not no_schedule)
    print(f"\nstack up: UI {record['ui_url']}\n"
          f"  eval \"$(rollout stack env)\"      # point `prefect` at it\n"
          f"  prefect deployment run train-rm/default && rollout follow --latest\n"
          f"  rollout stack stop                # stop worker and server")


@stack_group.command("stop")
def stack_stop() -> None:
    """Stop what `start` started."""
    stack.stop()


@stack_group.command("status")
def stack_status() -> int:
    """Print the stack's state as JSON; exit 1 when it is not running."""
    report = stack.status()
    print(json.dumps(report, indent=2))
    return 0 if report["running"] else 1


@stack_group.command("env")
def stack_env() -> None:
    """Print exports for `eval`: point `prefect` at the stack."""
    print(stack.shell_env(), end="")


# --- node -----------------------------------------------------------------------------------------------------


@rollout.group("node")
def node_group() -> None:
    """This machine as a node of multi-node runs (hardware.node_pool, docs/scale.md)."""


@node_group.command("start")
@click.option("--pool", required=True, metavar="POOL", help="the runs' hardware.node_pool (a process work pool)")
@click.option("--node", "node_rank", required=True, type=click.IntRange(min=1), metavar="K",
              help="this node's number, 1 .. nnodes-1 (node 0 runs the flow)")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=".",
              show_default=True, help="where this node's parts run")
@click.option("--poll-s", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="how often the worker asks for parts")
def node_start(pool: str, node_rank: int, directory: Path, poll_s: float) -> None:
    """Run node K's agent: a Prefect worker of POOL that starts node K's part of every rendezvous (foreground)."""
    import re

    from rollout_cli import node

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}", pool):
        raise click.BadParameter(f"{pool!r}: letters, digits, '_', '.', '-' (as hardware.node_pool)",
                                 param_hint="--pool")
    directory.mkdir(parents=True, exist_ok=True)
    node.start(pool, node_rank, directory.resolve(), poll_s)


# --- serve ----------------------------------------------------------------------------------------------------


@rollout.group("serve")
def serve_group() -> None:
    """Served models: vLLM OpenAI servers on 127.0.0.1 (records and logs in .rollout/serve)."""


@serve_group.command("start")
@click.argument("model")
@click.option("--name", help="served model name (default: from MODEL, e.g. tiny-qwen2)")
@click.option("--port", type=int, help="the first replica's port (default: a free one; the others are free ones)")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--store", "store_url", **STORE_OPTION_DEFAULT,
              help="store root (fsspec URL) where a checkpoint MODEL is found")
@click.option("--max-model-len", type=click.IntRange(min=1), help="default: min(max_position_embeddings, 2048)")
@click.option("--runner", type=click.Choice(["generate", "pooling"]), default="generate", show_default=True,
              help="pooling: a reward model (POST /classify)")
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=600, show_default=True, metavar="SECONDS")
@click.option("--live-policy", is_flag=True, help="a policy server for a run on another node "
              "(algorithm.rl.policy_sampler.base_url): each step's weights reloaded in place from the run's store")
@click.option("--lora-rank", type=click.IntRange(min=1), metavar="R",
              help="with --live-policy: the run trains a LoRA adapter of rank R (loaded in place each step)")
def serve_start(model: str, name: str | None, port: int | None, replicas: int, store_url: str,
                max_model_len: int | None, runner: str, ready_timeout: float, live_policy: bool,
                lora_rank: int | None) -> None:
    """Serve MODEL until `rollout serve stop`.

    MODEL: a local directory, pkg:<package>, tiny:qwen2, a checkpoint id or a ref (runs/NAME/latest) in --store,
    or a hub id in the Hugging Face cache. A deployment of that name already serving MODEL is reused.
    """
    from rollout_lib.serving import engine
    from rollout_lib.serving.policy_server import lora_server_args

    if lora_rank is not None and not live_policy:
        raise click.UsageError("--lora-rank: the rank of a live policy's adapter; give --live-policy too")
    deployment = engine.start_deployment(model, name=name, replicas=replicas, port=port, store_url=store_url,
                                         max_model_len=max_model_len, runner=runner, ready_timeout_s=ready_timeout,
                                         live_policy=live_policy,
                                         extra_args=lora_server_args(lora_rank) if lora_rank is not None else ())
    print(f"serving {deployment.name!r} ({deployment.model_dir}) on {len(deployment.replicas)} "
          f"replica{'s' if len(deployment.replicas) > 1 else ''}:")
    for replica in deployment.replicas:
        print(f"  {replica.base_url}/v1    (pid {replica.pid}, log {replica.log})")
    print(f'requests name "model": "{deployment.name}"; stop with: rollout serve stop {deployment.name}')


@serve_group.command("status")
def serve_status() -> int:
    """Print the running deployments as JSON; exit 1 when none runs."""
    from rollout_lib.serving import engine

    deployments = [deployment.describe() for deployment in engine.running_deployments()]
    print(json.dumps(deployments, indent=2))
    return 0 if deployments else 1


@serve_group.command("stop")
@click.argument("name", required=False)
@click.option("--all", "every", is_flag=True, help="stop every running deployment")
def serve_stop(name: str | None, every: bool) -> None:
    """Stop deployment NAME, or every one with --all."""
    from rollout_lib.serving import engine

    if name and every:
        raise UsageLine("serve stop: give NAME or --all, not both")
    if not name and not every:  # a bare command never stops servers that others (a teacher, a run) may be using
        raise UsageLine("serve stop: name the deployment to stop (`rollout serve status` lists them), or stop every "
                        "one with --all")
    stopped = [engine.stop_deployment(name)] if name else engine.stop_all()
    stopped = [deployment for deployment in stopped if deployment is not None]
    if name and not stopped:
        print(f"no served model {name!r} is running")
    for deployment in stopped:
        print(f"stopped {deployment.name!r} ({len(deployment.replicas)} replica"
              f"{'s' if len(deployment.replicas) > 1 else ''})")


# --- commands defined in their own modules --------------------------------------------------------------------

rollout.add_command(config_group)  # rollout config show|schema
rollout.add_command(runs_group)  # rollout runs [show|plot NAME]
rollout.add_command(follow)  # rollout follow FLOW_RUN_ID
