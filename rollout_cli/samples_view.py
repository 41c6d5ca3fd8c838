"""The terminal view of `rollout runs samples`: a step's samples (rows from rollout_lib.runlog.samples) as rich
panels, completions wrapped, rewards coloured by where they fall in the step's range."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

PROMPT_CHARS = 60  # a prompt is context: its last message, cut here; the completion is what is read in full
ID_CHARS = 12  # content ids abbreviated as git does (the full ones are in --json)


def print_samples(run: str, step: int, steps: list[int], every_row: list[dict], shown: list[dict], what: str,
                  held_out: bool = False) -> None:
    """``shown``: the rows to print (all of ``every_row``, or the worst / best / failed of them), described by
    ``what``; the header's mean and missing count are over ``every_row``, the whole step (``held_out``: the
    evaluation at that step). One panel per sample: a table's columns would leave the completion a sliver of an
    80-column terminal."""
    scored = [row["reward"] for row in every_row if row["reward"] is not None]
    low, high = (min(scored), max(scored)) if scored else (0.0, 0.0)
    sources = sorted({_short(row["sampled_from"]) for row in every_row})
    mean = f"reward mean {sum(scored) / len(scored):.3f}" if scored else "no rewards"
    console = Console()
    where = f"held-out evaluation at step {step} (evaluated at {_span(steps)})" if held_out else \
        f"step {step} (of {_span(steps)})"
    console.print(Text(f"{run} {where}: {what}; {len(every_row)} samples, {mean}, "
                       f"{len(every_row) - len(scored)} missing; sampled from {', '.join(sources)}", style="bold"))
    for row in shown:
        console.print(Panel(_body(row), title=_title(row, low, high), title_align="left", border_style="dim"))


def _title(row: dict, low: float, high: float) -> Text:
    title = Text(f"{row['sample_id']}  ")
    title.append_text(_reward(row["reward"], low, high))
    advantage = "-" if row["advantage"] is None else f"{row['advantage']:+.3f}"
    title.append(f"  adv {advantage}  tokens {row['prompt_tokens']}+{row['completion_tokens']}")
    if row["turns"] is not None:
        title.append(f"  {row['model_turns']} turns, {row['tool_calls']} tool replies, ended: {row['end']}")
    if "logprob_gap" in row:  # --trainer-logprobs
        gap = "-" if row["logprob_gap"] is None else f"{row['logprob_gap']:.2g}"
        title.append(f"  |sampler - trainer| logprob <= {gap}")
    return title


def _body(row: dict) -> Group:
    lines = [Text(f"prompt: {_prompt(row['prompt'])}", style="cyan")]
    if row["turns"] is None:
        lines.append(Text(row["completion"]))
    else:  # an episode: each segment under its role, the environment's dimmed
        for turn in row["turns"]:
            lines.append(Text(f"{turn['role']}: {turn['content']}", style="" if turn["sampled"] else "dim"))
    if row["rewards"] and len(row["rewards"]) + bool(row["reward_error"]) > 1:  # one function: the total says it
        lines.append(Text("  ".join(f"{_function_name(name)} {'failed' if value is None else f'{value:.3f}'}"
                                    for name, value in row["rewards"].items()), style="dim"))
    if row["reward_error"]:
        lines.append(Text(f"reward failed: {row['reward_error']}", style="bold red"))
    return Group(*lines)


def _function_name(name: str) -> str:
    return name.rpartition(":")[2]  # "package.module:function": the function says which


def _span(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    contiguous = steps == list(range(steps[0], steps[-1] + 1))
    return f"steps {steps[0]}-{steps[-1]}" if contiguous else f"steps {', '.join(map(str, steps))}"


def _short(source: str | None) -> str:
    if source is None:
        return "-"
    kind, _, rest = source.rpartition(":")  # frozen:<identity>, served:<name>, or a state id
    return f"{kind}:{rest[:ID_CHARS]}" if kind else source[:ID_CHARS]


def _prompt(messages: list[dict] | None) -> str:
    if not messages:
        return ""
    text = " ".join(messages[-1]["content"].split())
    return text if len(text) <= PROMPT_CHARS else text[:PROMPT_CHARS - 3] + "..."


def _reward(reward: float | None, low: float, high: float) -> Text:
    """Red at the step's lowest reward, green at its highest (yellow between); a missing one says so in red."""
    if reward is None:
        return Text("failed", style="bold red")
    share = 0.5 if high == low else (reward - low) / (high - low)
    style = "green" if share >= 2 / 3 else "red" if share < 1 / 3 else "yellow"
    return Text(f"{reward:.3f}", style=style)


