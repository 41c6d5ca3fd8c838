"""Helpers the data generators (make_pairs.py, make_sft.py) share for reading reasoning-gym items."""

from __future__ import annotations

import ast


def literal(value):
    """reasoning-gym metadata values are sometimes stringified Python literals: parse those, keep the rest."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def chain_steps(expr: str):
    """"3 + 4 - 2" -> (["3 + 4 = 7", "7 - 2 = 5"], 5); (None, None) for anything but +/- chains of integers."""
    tokens = expr.split()
    try:
        total = int(tokens[0])
        steps = []
        for i in range(1, len(tokens), 2):
            op, value = tokens[i], int(tokens[i + 1])
            if op not in ("+", "-"):
                return None, None
            new = total + value if op == "+" else total - value
            steps.append(f"{total} {op} {value} = {new}")
            total = new
        return steps, total
    except (ValueError, IndexError):
        return None, None
