"""Write recipes/data/arithmetic.jsonl: the prompt set of the GRPO quickstart (issue 28).

250 one-step arithmetic questions (+, -, x on numbers below 50), each with its `answer`; the quickstart holds out
50 of them with data.validation_split: 0.2 (seeded), to measure the reward before and after training. The
rewards that check `<answer>N</answer>` are recipes/data/arithmetic_rewards.yaml. Deterministic: running it again
writes the same bytes (tests/test_arithmetic_data.py checks the committed file is current).

    python recipes/data/make_arithmetic.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

RECORDS = 250
SEED = 28
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
INSTRUCTION = "Think briefly, then give only the final number inside <answer></answer> tags, like <answer>7</answer>."
OUTPUT = Path(__file__).with_name("arithmetic.jsonl")


def records(n: int = RECORDS, seed: int = SEED) -> list[dict]:
    """`n` distinct questions with their answers, drawn with `seed`."""
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    out = []
    while len(out) < n:
        op = rng.choice(sorted(OPERATIONS))
        a, b = rng.randint(2, 49), rng.randint(2, 49 if op != "*" else 12)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append({"prompt": f"What is {a} {op} {b}? {INSTRUCTION}", "answer": str(OPERATIONS[op](a, b))})
    return out


def text() -> str:
    return "".join(json.dumps(r) + "\n" for r in records())


if __name__ == "__main__":
    OUTPUT.write_text(text())
    print(f"wrote {RECORDS} records to {OUTPUT}")
