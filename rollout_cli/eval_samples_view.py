"""The terminal view of `rollout runs samples --eval`: an SFT or reward-model run's held-out examples (rows from
rollout_lib.runlog.eval_samples) as rich panels, one per example, as samples_view.py shows RL's samples."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from rollout_lib.runlog.eval_samples import EvalSamples

PROMPT_CHARS = 200  # a held-out prompt is short context; the responses or the completion are read in full


def print_eval_samples(found: EvalSamples, shown: list[dict], what: str) -> None:
    """``shown``: the rows to print, described by ``what``; the header's numbers are over every row."""
    console = Console()
    console.print(Text(f"{found.run} held-out evaluation at step {found.step} (evaluated at steps "
                       f"{', '.join(map(str, found.steps))}): {what}; {_summary(found)}", style="bold"))
    for row in shown:
        if found.algorithm == "rm":
            console.print(Panel(_pair_body(row), title=_pair_title(row), title_align="left", border_style="dim"))
        else:
            console.print(Panel(_example_body(row), title=_example_title(row), title_align="left",
                                border_style="dim"))


def _summary(found: EvalSamples) -> str:
    rows = found.rows
    if found.algorithm == "rm":
        correct = sum(row["correct"] for row in rows)
        return f"{len(rows)} pairs, accuracy {correct / len(rows):.3f} ({correct} right)"
    tokens = sum(row["tokens"] for row in rows)
    return f"{len(rows)} examples, loss {sum(row['nll_sum'] for row in rows) / tokens:.4f} per token over {tokens}"


def _pair_title(row: dict) -> Text:
    title = Text(f"pair {row['pair_index']} (line {row['source_line']})  margin ")
    title.append(f"{row['margin']:+.4f}", style="green" if row["correct"] else "red")
    title.append(f"  chosen {row['r_chosen']:.4f}  rejected {row['r_rejected']:.4f}  loss {row['loss']:.4f}")
    return title


def _pair_body(row: dict) -> Group:
    return Group(Text(f"prompt: {_cut(row['prompt'])}", style="cyan"), Text(f"chosen: {row['chosen']}"),
                 Text(f"rejected: {row['rejected']}", style="dim"))


def _example_title(row: dict) -> Text:
    return Text(f"{row['sample_id']}  loss {row['loss']:.4f} per token  (nll {row['nll_sum']:.3f} over "
                f"{row['tokens']} tokens)")


def _example_body(row: dict) -> Group:
    lines = [Text(f"{message['role']}: {_cut(message['content'])}", style="cyan") for message in row["prompt"] or []]
    lines.append(Text(f"assistant: {row['completion']}" if row["completion"] is not None else "(no assistant turn)"))
    return Group(*lines)


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= PROMPT_CHARS else text[:PROMPT_CHARS - 3] + "..."
