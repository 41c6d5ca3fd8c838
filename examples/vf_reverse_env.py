"""A verifiers SingleTurnEnv, written as for verifiers 0.3.x and run unchanged by rollout (docs/environments.md,
"verifiers environments"): reverse a short word. Its dataset is local rows (no hub), its rubric two reward
functions and two weight-0 metrics (one a group function, scoring a prompt's completions together), all reading the
parser's answer as verifiers' rubrics do.

    PYTHONPATH=examples rollout train rl --config configs/rl-verifiers-single.toml

`raise_on` (an env argument): the answers whose rollouts make one rubric function raise, to show what rollout does
with a rubric function that fails (a missing reward, counted; verifiers would have scored it 0).
"""

from datasets import Dataset

import verifiers as vf

WORDS = ["cat", "dog", "sun", "tree", "moon", "fish", "bird", "lamp"]
EVAL_WORDS = ["star", "rock", "leaf", "rain"]  # its eval_dataset: held-out words (`source = { ..., split = "eval" }`)


def load_environment(num_examples: int = 8, raise_on: list[str] | None = None) -> vf.Environment:
    rows = [{"question": f"Reverse the word: {word}", "answer": word[::-1]} for word in WORDS[:num_examples]]
    eval_rows = [{"question": f"Reverse the word: {word}", "answer": word[::-1]} for word in EVAL_WORDS]
    parser = vf.Parser()
    failing = set(raise_on or [])

    def exact_reverse(completion, answer, parser) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def shared_letters(completion, answer, parser) -> float:
        if answer in failing:
            raise RuntimeError(f"shared_letters was told to fail on {answer!r}")
        said = (parser.parse_answer(completion) or "").strip()
        return len(set(said) & set(answer)) / len(set(answer))

    def answer_length(completion, parser) -> float:  # weight 0: watched, not trained on
        return float(len((parser.parse_answer(completion) or "").strip()))

    def distinct_answers(completions, parser) -> list[float]:  # a group metric: the share of different answers
        said = [(parser.parse_answer(completion) or "").strip() for completion in completions]
        return [len(set(said)) / len(said)] * len(said)

    rubric = vf.Rubric(funcs=[exact_reverse, shared_letters, answer_length, distinct_answers],
                       weights=[1.0, 0.5, 0.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(eval_rows),
                            system_prompt="Answer with the reversed word only.", parser=parser, rubric=rubric)
