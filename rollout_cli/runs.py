"""`rollout runs`: the runs a store holds, and each step's metrics of one of them (docs/runs.md).

    rollout runs [--store URL]                                  # name, latest checkpoint, step, headline, updated
    rollout runs show NAME [--store URL] [--json] [--columns a,b]
    rollout runs plot NAME [--store URL] [--out PATH]              # the curves as a PNG
    rollout runs samples NAME [--store URL] [--step N] [--worst K | --best K | --failed] [--tokens] [--json]
    rollout runs samples NAME --eval [--step 0|N] [--worst K | --best K] [--json]   # held-out samples / examples

Read-only. An unknown run or a missing store is a StoreError: `rollout: error: no run 'x' in <store>`, exit 2.
"""

from __future__ import annotations

import math
import time

import click

# Shown by `runs show` when a run has them, in this order: the numbers one reads a run by, for every kind of run
# (a reward model, SFT, RL), then RL's held-out reward per env (`eval/<env>/reward_mean`). --columns picks others;
# --json prints everything.
COMPACT_COLUMNS = ("reward_mean", "reward_std", "loss", "accuracy", "mean_margin", "tokens/ce", "eval/accuracy",
                   "eval/loss", "lr", "grad_norm")
HELD_OUT_REWARD_SUFFIX = "/reward_mean"
_STORE_HELP = "store root (fsspec URL) [default: .rollout/store]"


def _open_store(store_url: str | None):
    from rollout_cli.options import default_store_url
    from rollout_lib.store import ObjectStore

    return ObjectStore(store_url or default_store_url())


@click.group("runs", invoke_without_command=True)
@click.option("--store", "store_url", metavar="URL", help=_STORE_HELP)
@click.pass_context
def runs_group(ctx: click.Context, store_url: str | None) -> None:
    """List the runs in a store: name, latest checkpoint, step, headline metric, last update.

    The headline: a reward model's held-out accuracy (else its training accuracy), an SFT model's held-out loss
    (else its loss), an RL policy's reward_mean, at its last recorded step.
    """
    ctx.obj = {"store": store_url}
    if ctx.invoked_subcommand is not None:
        return
    from rollout_lib.runlog.runs import list_runs

    store = _open_store(store_url)
    summaries = list_runs(store)
    if not summaries:
        click.echo(f"no runs in {store.root}")
        return
    rows = [("run", "checkpoint", "step", "headline", "updated")]
    for run in summaries:
        step = "-" if run.last_step is None else str(run.last_step)
        if run.checkpoint_step is not None and run.last_step is not None and run.last_step != run.checkpoint_step:
            step = f"{run.checkpoint_step} ({run.last_step} recorded)"
        rows.append((run.name, run.checkpoint[:12] if run.checkpoint else "-", step,
                     f"{run.headline[0]} {_number(run.headline[1])}" if run.headline else "-",
                     _when(run.updated, "%Y-%m-%d %H:%M:%S")))
    _print_table(rows, right=(2,))


@runs_group.command("show")
@click.argument("name")
@click.option("--store", "store_url", metavar="URL", help=_STORE_HELP)
@click.option("--json", "as_json", is_flag=True, help="every metric, one JSON object per step (as the metrics file)")
@click.option("--columns", metavar="NAME,NAME,...", help="the metrics to show (default: a compact choice)")
@click.pass_context
def runs_show(ctx: click.Context, name: str, store_url: str | None, as_json: bool, columns: str | None) -> None:
    """Print run NAME's metrics, one row per step (step 0: the held-out evaluation before training)."""
    from rollout_lib.runlog.metrics_file import WALL_TIME, json_line
    from rollout_lib.runlog.runs import run_history

    store = _open_store(store_url or (ctx.obj or {}).get("store"))
    history = run_history(store, name)
    if as_json:
        for record in history:
            click.echo(json_line(record))
        return
    if not history:
        click.echo(f"run {name!r} in {store.root} has no recorded steps yet")
        return
    if columns:
        shown = [column.strip() for column in columns.split(",") if column.strip()]
    else:
        present = {metric for record in history for metric in record}
        shown = [column for column in COMPACT_COLUMNS if column in present]
        shown += sorted(metric for metric in present
                        if metric.startswith("eval/") and metric.endswith(HELD_OUT_REWARD_SUFFIX))
    with_time = any(WALL_TIME in record for record in history)
    rows = [("step", *shown, *(("time",) if with_time else ()))]
    for record in history:
        rows.append((str(record["step"]), *(_number(record.get(column)) for column in shown),
                     *((_when(record.get(WALL_TIME), "%m-%d %H:%M:%S"),) if with_time else ())))
    _print_table(rows, right=range(len(shown) + 1))


@runs_group.command("plot")
@click.argument("name")
@click.option("--store", "store_url", metavar="URL", help=_STORE_HELP)
@click.option("--out", "out_path", metavar="PATH", help="the PNG to write [default: NAME-curves.png]")
@click.pass_context
def runs_plot(ctx: click.Context, name: str, store_url: str | None, out_path: str | None) -> None:
    """Write run NAME's curves (loss, accuracy or reward, held-out metrics) as a PNG."""
    from pathlib import Path

    from rollout_lib.runlog.plot import plot_curves
    from rollout_lib.runlog.runs import run_history

    store = _open_store(store_url or (ctx.obj or {}).get("store"))
    history = run_history(store, name)
    if not history:
        raise click.ClickException(f"run {name!r} in {store.root} has no recorded steps yet")
    target = Path(out_path or f"{name}-curves.png")
    target.write_bytes(plot_curves(history, f"{name}: step {history[-1]['step']}"))
    click.echo(f"wrote {target}")


@runs_group.command("samples")
@click.argument("name")
@click.option("--store", "store_url", metavar="URL", help=_STORE_HELP)
@click.option("--step", type=click.IntRange(min=0),
              help="the RL step [default: the latest with samples]; with --eval, the evaluation's step (0: before "
                   "training) [default: the last]")
@click.option("--eval", "held_out", is_flag=True,
              help="the held-out evaluation: an RL run's samples; an SFT or RM run's examples with the model's "
                   "predictions, worst first")
@click.option("--worst", type=click.IntRange(min=1), metavar="K", help="the K samples of lowest reward")
@click.option("--best", type=click.IntRange(min=1), metavar="K", help="the K samples of highest reward")
@click.option("--failed", is_flag=True, help="the samples whose reward is missing, with why")
@click.option("--tokens", is_flag=True, help="with --json: each completion token's ids and logprobs")
@click.option("--trainer-logprobs", is_flag=True,
              help="compute the trainer's logprob of every sampled token at the state that sampled it (the policy "
                   "rebuilt from the store: slow on a large model) and show each sample's largest |sampler - "
                   "trainer| gap; with --json --tokens, each token's trainer_logprob")
@click.option("--json", "as_json", is_flag=True, help="one JSON document: {run, step, steps, samples, selection, rows}")
@click.pass_context
def runs_samples(ctx: click.Context, name: str, store_url: str | None, step: int | None, held_out: bool,
                 worst: int | None, best: int | None, failed: bool, tokens: bool, trainer_logprobs: bool,
                 as_json: bool) -> None:
    """Print one step of RL run NAME sample by sample: prompt, completion, rewards, advantage, tokens. With --eval,
    the held-out evaluation: an RL run's samples, an SFT or reward-model run's examples with their loss (SFT) or
    scores (RM), worst first."""
    from rollout_cli.options import UsageLine
    from rollout_lib.runlog import samples
    from rollout_lib.runlog.metrics_file import json_line

    if sum((worst is not None, best is not None, failed)) > 1:
        raise UsageLine("runs samples: --worst, --best and --failed pick one selection; give one of them")
    if tokens and not as_json:
        raise UsageLine("runs samples: --tokens goes with --json")
    if trainer_logprobs and held_out:
        raise UsageLine("runs samples: --trainer-logprobs is for a training step's samples, not --eval's")
    store = _open_store(store_url or (ctx.obj or {}).get("store"))
    if held_out:
        _held_out_samples(store, name, step, worst, best, failed, tokens, as_json)
        return
    found = samples.read_samples(store, name, step, tokens=tokens or trainer_logprobs)
    if trainer_logprobs:
        from rollout_lib.rl.trainer_logprobs import trainer_logprobs as compute

        samples.with_trainer_logprobs(found.rows, compute(store, name, found.step), keep_tokens=tokens)
    selection = {"worst": worst} if worst else {"best": best} if best else {"failed": True} if failed else {}
    shown = samples.select(found.rows, **selection)
    what = f"the {worst} worst" if worst else f"the {best} best" if best else "the failed" if failed else "every sample"
    if as_json:
        click.echo(json_line({"run": found.run, "step": found.step, "steps": found.steps, "samples": len(found.rows),
                              "selection": selection, "rows": shown}))
        return
    from rollout_cli.samples_view import print_samples

    print_samples(found.run, found.step, found.steps, found.rows, shown, what)


def _held_out_samples(store, name: str, step: int | None, worst: int | None, best: int | None, failed: bool,
                      tokens: bool, as_json: bool) -> None:
    from rollout_cli.options import UsageLine
    from rollout_lib.runlog.eval_samples import read_eval_rows, worst_first
    from rollout_lib.runlog.eval_tables import recorded_rl_evals
    from rollout_lib.runlog.metrics_file import json_line

    if recorded_rl_evals(store, name):  # an RL run: its held-out samples, as a step's
        _rl_held_out_samples(store, name, step, worst, best, failed, tokens, as_json)
        return
    if failed or tokens:
        raise UsageLine("runs samples: an SFT or RM run's --eval takes --step, --worst or --best and --json, not "
                        "--failed or --tokens")
    found = read_eval_rows(store, name, step)
    shown = worst_first(found, worst=worst, best=best)
    selection = {"worst": worst} if worst else {"best": best} if best else {}
    if as_json:
        click.echo(json_line({"run": found.run, "step": found.step, "steps": found.steps,
                              "algorithm": found.algorithm, "examples": len(found.rows), "selection": selection,
                              "rows": shown}))
        return
    from rollout_cli.eval_samples_view import print_eval_samples

    what = f"the {worst} worst" if worst else f"the {best} best" if best else "every example, worst first"
    print_eval_samples(found, shown, what)


def _rl_held_out_samples(store, name: str, step: int | None, worst: int | None, best: int | None, failed: bool,
                         tokens: bool, as_json: bool) -> None:
    from rollout_lib.runlog import samples
    from rollout_lib.runlog.metrics_file import json_line

    found = samples.read_eval_samples(store, name, step, tokens=tokens)
    selection = {"worst": worst} if worst else {"best": best} if best else {"failed": True} if failed else {}
    shown = samples.select(found.rows, **selection)
    if as_json:
        click.echo(json_line({"run": found.run, "step": found.step, "steps": found.steps, "held_out": True,
                              "samples": len(found.rows), "selection": selection, "rows": shown}))
        return
    from rollout_cli.samples_view import print_samples

    what = f"the {worst} worst" if worst else f"the {best} best" if best else "the failed" if failed else "every sample"
    print_samples(found.run, found.step, found.steps, found.rows, shown, what, held_out=True)


def _number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _when(seconds, fmt: str) -> str:
    return time.strftime(fmt, time.localtime(seconds)) if isinstance(seconds, (int, float)) else "-"


def _print_table(rows: list[tuple[str, ...]], right) -> None:
    right = set(right)
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    for row in rows:
        cells = [cell.rjust(width) if index in right else cell.ljust(width)
                 for index, (cell, width) in enumerate(zip(row, widths))]
        click.echo("  ".join(cells).rstrip())
