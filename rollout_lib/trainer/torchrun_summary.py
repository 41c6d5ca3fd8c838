"""torchrun's failure summary read: which rank failed first, how, and the one-line message that names it.

Torch-free (regular expressions over output lines), so that a node agent's part (trainer/node_agent.py) reports its
torchrun's failure without importing torch in its flow run's process: torchrun, its child, imports it anyway.
"""

from __future__ import annotations

import re


def failure_message(where: str, returncode: int | None, tail: list[str], rerun: str) -> str:
    """`where`: which rank failed and how, from torchrun's failure summary ("rank : 1 (local_rank: 1)",
    "exitcode : -9", "traceback : Signal 9 (SIGKILL) received by PID ..."), else the last lines of output; then
    what a rerun does (`rerun`) and the last output."""
    failure = first_failure(tail)
    if failure is not None:
        cause = failure["traceback"] or f"exit code {failure['exitcode']}"
        # torchrun's placeholder, or the first line of a traceback: the worker's own error is in the output above
        if cause.startswith(("To enable traceback", "Traceback")):
            errors = [line for line in tail if re.search(r"\b\w+(Error|Exception)\b:", line)
                      and "ChildFailedError" not in line]
            cause = errors[-1].strip() if errors else f"exit code {failure['exitcode']}"
        elif isinstance(failure["exitcode"], int) and failure["exitcode"] < 0 \
                and failure["exitcode"] not in (SIGKILL_EXIT, SIGTERM_EXIT):
            # a signal the rank raised on itself (SIGABRT: a C++ `terminate called ...`, SIGSEGV): why is in what
            # it printed last, above torchrun's summary, which alone fills the last 20 lines
            last = output_before_summary(tail)[-LAST_WORDS:]
            if last:
                cause += "; its last output: " + " | ".join(line.strip() for line in last)
        message = f"{where}: rank {failure['rank']} exited with code {failure['exitcode']} ({cause})"
    else:
        message = f"{where}: torchrun exited with code {returncode}"
    return f"{message}; {rerun}.\nlast output:\n" + "\n".join(tail[-20:])


# A torchrun agent's own log line ("E1127 21:26:11.133000 11183 torch/distributed/elastic/...] failed (exitcode:
# -6) local_rank: 0 ..."): where the ranks' output ends and torchrun's account of their failure begins.
_AGENT_LOG = re.compile(r"^\[?[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+ \d+ \S*torch/distributed/")
LAST_WORDS = 5  # how many of a rank's last lines a signal's cause quotes
SIGKILL_EXIT = -9


def output_before_summary(tail: list[str]) -> list[str]:
    """The ranks' own last lines: the output before torchrun's failure report (its agent's first log line about the
    failure, or the traceback that raises ChildFailedError), its agent's log lines left out, blank lines too."""
    end = next((i for i, line in enumerate(tail) if _AGENT_LOG.match(line) and "failed (exitcode" in line), None)
    if end is None:
        raised = next((i for i, line in enumerate(tail) if "ChildFailedError" in line), len(tail))
        end = max((i for i, line in enumerate(tail[:raised]) if line.startswith("Traceback (most recent call last)")),
                  default=raised)
    return [line for line in tail[:end] if line.strip() and not _AGENT_LOG.match(line)]


_FAILURE = re.compile(r"^\s*\[\d+\]:\s*$")
_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
SIGTERM_EXIT = -15  # how torchrun stops the ranks still running once one has failed


def first_failure(tail: list[str]) -> dict | None:
    """The failure that started it, from torchrun's summary: {"rank", "exitcode", "traceback"}, or None when the
    output holds no summary. torchrun names its "Root Cause" by time, at one-second resolution, so a rank it
    stopped itself (SIGTERM, once another rank died) can tie with the rank that died and win on rank order: a
    failure that is not torchrun's own SIGTERM is preferred."""
    text = "\n".join(tail)
    start = text.rfind("Failures:")
    if start < 0:
        return None
    failures, current = [], None
    for line in text[start:].splitlines():
        if _FAILURE.match(line):
            current = {}
            failures.append(current)
            continue
        found = _FIELD.match(line)
        if current is not None and found and found.group(1) not in current:  # a traceback's own lines may match
            current[found.group(1)] = found.group(2).strip()
    failures = [parsed for parsed in map(_parsed_failure, failures) if parsed is not None]
    if not failures:
        return None
    root = failures[-1]  # torchrun lists its root cause last
    if root["exitcode"] == SIGTERM_EXIT:
        return next((failure for failure in failures if failure["exitcode"] != SIGTERM_EXIT), root)
    return root


def _parsed_failure(fields: dict[str, str]) -> dict | None:
    rank = re.match(r"(\d+)", fields.get("rank", ""))
    if rank is None:
        return None
    code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
    return {"rank": int(rank.group(1)), "exitcode": int(code.group(1)) if code else "?",
            "traceback": fields.get("traceback", "")}


def root_cause_rank(tail: list[str]) -> int | None:
    """The rank whose failure started it (first_failure), if torchrun's summary names one."""
    failure = first_failure(tail)
    return failure["rank"] if failure is not None else None
