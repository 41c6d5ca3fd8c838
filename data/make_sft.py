#!/usr/bin/env python3
"""Generate small chat-style SFT data sets from seeded reasoning-gym generators.

    python data/make_sft.py       # writes data/sft-tiny.jsonl, data/sft-train.jsonl, data/sft-eval.jsonl

Row shapes (mixed in every file):
    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   (single- and multi-turn)

Questions and reference answers come from reasoning-gym (Apache-2.0): basic_arithmetic, chain_sum,
spell_backward, letter_counting, word_sequence_reversal. Answer phrasings, system prompts and
follow-up turns are our templates; every follow-up answer is computed, so all assistant turns are correct.
Deterministic: fixed seeds, no iteration over hashed containers; two runs give byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import reasoning_gym as rg

from rg_helpers import chain_steps, literal  # data/ is sys.path[0] when run as a script

HERE = Path(__file__).resolve().parent
SEED = 20250602
N_TRAIN = 800
N_EVAL = 100

TASKS = [  # name, config, weight
    ("basic_arithmetic", dict(min_terms=2, max_terms=5, max_digits=3), 3),
    ("chain_sum", dict(min_terms=2, max_terms=6, max_digits=3), 3),
    ("spell_backward", dict(min_word_len=3, max_word_len=10), 3),
    ("letter_counting", dict(min_words=3, max_words=8), 1),
    ("word_sequence_reversal", dict(min_words=3, max_words=7), 1),
]

SYSTEMS_BRIEF = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a precise assistant. Give short, correct answers.",
]
SYSTEMS_STEPS = [
    "You are a patient tutor. Explain your reasoning step by step before giving the answer.",
    "You are a friendly math and word-games tutor. Show your work, then state the final answer.",
]
THANKS = ["Thanks!", "Great, thank you.", "Perfect, thanks.", "Got it, thanks!"]
YOURE_WELCOME = ["You're welcome!", "Happy to help!", "Anytime. Let me know if you have more questions.",
                 "Glad I could help."]




def answers(name, it):
    """Return (brief, sentence, worked) answer texts for a reasoning-gym item."""
    a, m = str(it["answer"]), it["metadata"]
    if name in ("basic_arithmetic", "chain_sum"):
        expr = m["expression"]
        steps, val = chain_steps(expr)
        if steps and len(steps) > 1 and str(val) == a:
            worked = "Let's go left to right:\n" + "\n".join(f"- {s}" for s in steps) + f"\n\nThe answer is {a}."
        else:
            worked = (f"Apply the order of operations: multiplication and division first, then addition and "
                      f"subtraction from left to right. Evaluating {expr} that way gives {a}.\n\nThe answer is {a}.")
        return a, f"{expr} = {a}", worked
    if name == "spell_backward":
        w = m["word"]
        worked = (f'The word "{w}" has {len(w)} letters: {", ".join(w)}.\n'
                  f'Reading them from last to first gives {", ".join(a)}.\n\nSo "{w}" backward is "{a}".')
        return a, f'"{w}" spelled backward is "{a}".', worked
    if name == "letter_counting":
        letter = m["target_letter"]
        words = literal(m["span"])
        hits = [f'"{w}" ({w.lower().count(letter)})' for w in words if letter in w.lower()]
        worked = (f'Go through the words and count "{letter}": ' + ", ".join(hits) + f".\n\nIn total, \"{letter}\" appears {a} times.")
        return a, f'The letter "{letter}" appears {a} times.', worked
    if name == "word_sequence_reversal":
        words = literal(m["words"])
        worked = (f"The list has {len(words)} words. Taking them from last to first:\n"
                  + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(reversed(words))) + f"\n\nAnswer: {a}")
        return a, a, worked
    raise KeyError(name)


def followup(rng, name, it):
    """A computed follow-up question about the same item, or None."""
    a, m = str(it["answer"]), it["metadata"]
    if name in ("basic_arithmetic", "chain_sum"):
        try:
            v = int(a)
        except ValueError:
            return None
        k = rng.randint(2, 12)
        kind = rng.randrange(3)
        if kind == 0:
            return f"Now add {k} to that.", f"{v} + {k} = {v + k}"
        if kind == 1:
            return f"And if you multiply the result by {k}?", f"{v} × {k} = {v * k}"
        return "Is that number even or odd?", f"{v} is {'even' if v % 2 == 0 else 'odd'}."
    if name == "spell_backward":
        w = m["word"]
        kind = rng.randrange(3)
        if kind == 0:
            return "How many letters does the word have?", f'"{w}" has {len(w)} letters.'
        if kind == 1:
            return "Now write it in capital letters.", a.upper()
        return "What is its first letter?", f'The backward spelling "{a}" starts with "{a[0]}".'
    if name == "letter_counting":
        return "Is that an even number?", "Yes." if int(a) % 2 == 0 else "No, it's odd."
    if name == "word_sequence_reversal":
        words = literal(m["words"])
        return "Which word ends up first?", f'"{words[-1]}" comes first after reversing.'
    return None


def pool(seed_base, n_per_weight, exclude):
    """Items tagged with their task name, deduplicated on the question text."""
    out = []
    for ti, (name, cfg, w) in enumerate(TASKS):
        want = n_per_weight * w
        ds = rg.create_dataset(name, seed=seed_base + ti, size=want * 4, **cfg)
        seen = []
        for i in range(len(ds)):
            if len(seen) >= want:
                break
            it = ds[i]
            q = it["question"].strip()
            if q in exclude or q in seen:
                continue
            seen.append(q)
            out.append((name, it))
    return out


def pick_answer(rng, name, it, style):
    brief, sentence, worked = answers(name, it)
    if style == "brief":
        return rng.choice([brief, brief, sentence])
    if style == "steps":
        return worked
    return rng.choice([brief, sentence, worked])


def make_row(rng, name, it, items):
    q = it["question"].strip()
    r = rng.random()
    if r < 0.35:  # prompt / completion
        return {"prompt": q, "completion": pick_answer(rng, name, it, "any")}
    if r < 0.65:  # single-turn chat, sometimes with a system prompt
        msgs = []
        style = "any"
        if rng.random() < 0.4:
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": rng.choice(SYSTEMS_BRIEF)})
                style = "brief"
            else:
                msgs.append({"role": "system", "content": rng.choice(SYSTEMS_STEPS)})
                style = "steps"
        msgs.append({"role": "user", "content": q})
        msgs.append({"role": "assistant", "content": pick_answer(rng, name, it, style)})
        return {"messages": msgs}
    # multi-turn chat: two or three exchanges
    msgs = []
    style = rng.choice(["brief", "steps", "any"])
    if rng.random() < 0.6:
        sys_pool = SYSTEMS_BRIEF if style == "brief" else SYSTEMS_STEPS if style == "steps" else SYSTEMS_BRIEF[:1]
        msgs.append({"role": "system", "content": rng.choice(sys_pool)})
    msgs.append({"role": "user", "content": q})
    msgs.append({"role": "assistant", "content": pick_answer(rng, name, it, style)})
    fu = followup(rng, name, it)
    kind = rng.random()
    if fu is not None and kind < 0.6:
        msgs.append({"role": "user", "content": fu[0]})
        msgs.append({"role": "assistant", "content": fu[1]})
    else:  # a second, unrelated question from the pool
        name2, it2 = rng.choice(items)
        msgs.append({"role": "user", "content": rng.choice(["Another one: ", "Next: ", "", "Now this: "]) + it2["question"].strip()})
        msgs.append({"role": "assistant", "content": pick_answer(rng, name2, it2, style)})
    if rng.random() < 0.25:
        msgs.append({"role": "user", "content": rng.choice(THANKS)})
        msgs.append({"role": "assistant", "content": rng.choice(YOURE_WELCOME)})
    return {"messages": msgs}


def build_split(items, n, seed):
    rng = random.Random(seed)
    items = list(items)
    rng.shuffle(items)
    rows = [make_row(rng, name, it, items) for name, it in items[:n]]
    return rows


TINY = [
    {"prompt": "What is 2+2?", "completion": "4"},
    {"prompt": "Spell this word backward (example: sun -> nus): cat", "completion": "tac"},
    {"messages": [
        {"role": "user", "content": "State the final answer to the following arithmetic problem: 12 + 30 - 7 ="},
        {"role": "assistant", "content": "12 + 30 = 42, then 42 - 7 = 35. The answer is 35."},
    ]},
    {"messages": [
        {"role": "system", "content": "You are a concise assistant. Answer briefly."},
        {"role": "user", "content": "Calculate 6 * 7."},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Now add 8 to that."},
        {"role": "assistant", "content": "42 + 8 = 50"},
    ]},
]


def first_user(row):
    if "prompt" in row:
        return row["prompt"]
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def write(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def build():
    ev_items = pool(SEED + 500, n_per_weight=12, exclude=[])
    ev_q = [it["question"].strip() for _, it in ev_items]
    tr_items = pool(SEED + 100, n_per_weight=80, exclude=ev_q)
    ev = build_split(ev_items, N_EVAL, SEED + 1)
    tr = build_split(tr_items, N_TRAIN, SEED + 2)
    # multi-turn rows may pull a second question from their own split only, so splits stay disjoint
    return TINY, tr, ev


def main():
    tiny, tr, ev = build()
    write(HERE / "sft-tiny.jsonl", tiny)
    write(HERE / "sft-train.jsonl", tr)
    write(HERE / "sft-eval.jsonl", ev)
    assert not ({first_user(r) for r in tr} & {first_user(r) for r in ev})
    for name, rows in (("sft-tiny", tiny), ("sft-train", tr), ("sft-eval", ev)):
        pc = sum("prompt" in r for r in rows)
        multi = sum("messages" in r and sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows)
        print(f"{name}.jsonl: {len(rows)} rows ({pc} prompt/completion, {len(rows) - pc - multi} single-turn chat, "
              f"{multi} multi-turn chat)")


if __name__ == "__main__":
    main()
