"""The collapse guard: whether an RL run's steps stopped carrying a learning signal, read from their metrics alone.

A run can collapse: the calculator policy stops calling its tool, every episode is one turn, every reward 0, and
from then on every group's rewards are equal, so the rl component has nothing to push on and the run trains on
nothing for the rest of its budget. Two symptoms, each read from one step's metrics:

- no rl signal: at least `zero_advantage_fraction` of the step's rl samples have advantage 0 (the metric of that
  name; every group's rewards equal, under a group-relative algorithm), in a step that trains rl (`rl_tokens`),
  at a reward below the best an earlier step reached. Equal rewards at the run's best, once it rose, are a solved
  task (every group saturated), not a collapse; from step 1 (no rise yet) they are (a reward that never varies);
- entropy: the tokens the policy sampled have a mean -logprob (`sampled_entropy`, rl/sample.py) below
  `min_entropy`: the policy samples one continuation whatever the seed, so no group can tell two apart; at the
  run's best reward once it rose, that is a policy converged on what is rewarded (SmolLM2 with tool calls: every
  sample calls and answers right from step 2), not a collapse.

A symptom held for `patience` consecutive steps is a collapse that began at the first of them. It is said once, in
one line naming that step, what the step before it looked like and what to do; again only after a step without
that symptom. `action = "fail"` raises RlCollapseError with that line instead (the steps already trained stay in
the store: a rerun is a resume).

The guard's state is a function of the steps it was fed, in order: train-rl reports every step, from cache on a
rerun, so a resumed run rebuilds it and reaches the same verdict at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_lib.config.rl import CollapseSettings

DOC = 'docs/runs.md, "When RL collapses"'


class RlCollapseError(RuntimeError):
    """The run collapsed and `algorithm.rl.collapse.action` is "fail"; the message is the guard's one line."""


def _number(value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "n/a"
    text = f"{value:.3g}"
    return text if any(c in text for c in ".en") else f"{text}.0"  # 0.0, not 0: a mean, not a count


def _no_signal(metrics: dict, settings: CollapseSettings, rewards: tuple[float, float] | None) -> bool:
    """`rewards`: the (lowest, highest) reward_mean of the steps before this one, None before any."""
    fraction = metrics.get("zero_advantage_fraction")
    if not (metrics.get("rl_tokens") and isinstance(fraction, (int, float))
            and fraction >= settings.zero_advantage_fraction):
        return False
    return not _solved(metrics, rewards)


def _solved(metrics: dict, rewards: tuple[float, float] | None) -> bool:
    """The step's reward is at the best an earlier step reached, after the run's reward rose: a solved task."""
    reward = metrics.get("reward_mean")
    return rewards is not None and isinstance(reward, (int, float)) and rewards[1] > rewards[0] \
        and reward >= rewards[1]


def _low_entropy(metrics: dict, settings: CollapseSettings, rewards: tuple[float, float] | None) -> bool:
    # One answer sampled at the run's best reward is a policy that converged on what is rewarded, not a collapse.
    entropy = metrics.get("sampled_entropy")
    return settings.min_entropy > 0 and isinstance(entropy, (int, float)) and entropy < settings.min_entropy \
        and not _solved(metrics, rewards)


def _episode(metrics: dict) -> str:
    """`reward 0.0 and 1.0 turns per episode` (multi-turn envs), else `reward 0.0`."""
    turns = metrics.get("turns_mean")
    return f"reward {_number(metrics.get('reward_mean'))}" + (
        f" and {_number(turns)} turns per episode" if turns is not None else "")


def _no_signal_text(now: dict, before: dict | None, steps: int, settings: CollapseSettings) -> str:
    was = ""
    if before is not None:
        turns = before.get("turns_mean")
        was = f" (was {_number(before.get('reward_mean'))}" + (
            f" and {_number(turns)}" if turns is not None and now.get("turns_mean") is not None else "") + \
            f" at step {before['step']})"
    return f"{_episode(now)} for {steps} steps{was}: every group's rewards are equal, no rl signal"


def _entropy_text(now: dict, before: dict | None, steps: int, settings: CollapseSettings) -> str:
    was = f" (was {_number(before.get('sampled_entropy'))} at step {before['step']})" if before is not None else ""
    return (f"sampled entropy {_number(now.get('sampled_entropy'))} for {steps} steps{was}: under min_entropy "
            f"{_number(settings.min_entropy)}, the policy samples one answer")


# name -> (does a step show it, its words in the line: (the step, the step before the symptom, how many steps,
# settings) -> text)
SYMPTOMS = {
    "no_signal": (_no_signal, _no_signal_text),
    "entropy": (_low_entropy, _entropy_text),
}


@dataclass(frozen=True)
class Collapse:
    began: int  # the first step of the symptoms' run
    symptoms: tuple[str, ...]  # names in SYMPTOMS
    line: str


@dataclass
class _Streak:
    first: int
    before: dict | None  # the step before it (what the line compares with), None from step 1
    steps: int = 1
    said: bool = False


@dataclass
class CollapseGuard:
    """Fed each step's metrics in order (`check`); `CollapseGuard(settings)` with the run's `algorithm.rl.collapse`."""

    settings: CollapseSettings
    _streaks: dict[str, _Streak] = field(default_factory=dict)
    _previous: dict | None = None
    _rewards: tuple[float, float] | None = None  # (lowest, highest) reward_mean fed so far

    def observe(self, metrics: dict) -> Collapse | None:
        """The collapse this step completes (a symptom `patience` steps long, not said yet), or None."""
        settings = self.settings
        if settings.action == "off":
            return None
        due = []
        for name, (shows, _) in SYMPTOMS.items():
            if not shows(metrics, settings, self._rewards):
                self._streaks.pop(name, None)
                continue
            streak = self._streaks.get(name)
            if streak is None:
                streak = self._streaks[name] = _Streak(metrics["step"], self._previous)
            else:
                streak.steps += 1
            if streak.steps >= settings.patience and not streak.said:
                streak.said = True
                due.append(name)
        self._previous = metrics
        reward = metrics.get("reward_mean")
        if isinstance(reward, (int, float)):
            low, high = self._rewards or (reward, reward)
            self._rewards = (min(low, reward), max(high, reward))
        if not due:
            return None
        began = min(self._streaks[name].first for name in due)
        parts = [describe(metrics, self._streaks[name].before, self._streaks[name].steps, settings)
                 for name, (_, describe) in SYMPTOMS.items() if name in due]
        return Collapse(began, tuple(due), collapse_line(began, parts, settings))

    def check(self, metrics: dict) -> str | None:
        """`observe`, acted on: the warning line of a collapse (action "warn"), RlCollapseError with that line
        (action "fail"), else None."""
        collapse = self.observe(metrics)
        if collapse is None:
            return None
        if self.settings.action == "fail":
            raise RlCollapseError(collapse.line)
        return collapse.line


def collapse_line(began: int, parts: list[str], settings: CollapseSettings) -> str:
    """`rl collapsed at step 5: <each symptom, against the step before it>; <what to do> (<where it is explained>)`."""
    advice = (f"try a lower algorithm.rl.optimizer.lr, from a checkpoint before step {began}" if began > 1 else
              "check the reward and the prompts' difficulty")
    if settings.action == "fail":
        advice += ("; stopped by algorithm.rl.collapse.action = \"fail\": the trained steps are kept, a rerun with "
                   "action \"warn\" trains on")
    return f"rl collapsed at step {began}: {'; '.join(parts)}; {advice} ({DOC})"
