"""A verifiers ToolEnv, written as for verifiers 0.3.x and run unchanged by rollout (docs/environments.md,
"verifiers environments"): add two numbers with an `add` tool. Local dataset rows (no hub); ToolEnv adds its own
metrics (`total_tool_calls`, `add_calls`) and MultiTurnEnv `num_turns`, which reach the step's metrics.

    PYTHONPATH=examples rollout train rl --config configs/rl-verifiers-tools.toml
"""

from datasets import Dataset

import verifiers as vf

PAIRS = [(3, 4), (12, 30), (7, 8), (21, 21), (5, 9), (40, 2)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        Their sum.
    """
    return a + b


def load_environment(max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"What is {a} + {b}? Use the add tool, then answer with the number.", "answer": str(a + b)}
            for a, b in PAIRS]
    parser = vf.Parser()

    def correct_sum(completion, answer, parser) -> float:
        return 1.0 if answer in (parser.parse_answer(completion) or "") else 0.0

    rubric = vf.Rubric(funcs=[correct_sum], weights=[1.0], parser=parser)
    return vf.ToolEnv(tools=[add], max_turns=max_turns, dataset=Dataset.from_list(rows), parser=parser,
                      rubric=rubric)
