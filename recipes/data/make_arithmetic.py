"""Write recipes/data/arithmetic.jsonl: the prompt set of the GRPO quickstart.

250 small sums and differences (numbers 1 to 20, never below zero), each with its `answer`; the quickstart holds
out 50 of them with data.validation_split: 0.2 (seeded), to measure the reward before and after training. Small
on purpose: SmolLM2-135M answers about 40% of them right before training (a GRPO group needs right and wrong
answers to learn from), and 2 CPU cores train it in minutes. The rewards (the reply's last number, a short reply)
are recipes/data/arithmetic_rewards.yaml. Deterministic: running it again writes the same bytes
(tests/test_arithmetic_data.py checks the committed file is current).

    python recipes/data/make_arithmetic.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

RECORDS = 250
SEED = 28
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
INSTRUCTION = "Reply with just the number."
OUTPUT = Path(__file__).with_name("arithmetic.jsonl")


def records(n: int = RECORDS, seed: int = SEED) -> list[dict]:
    """`n` distinct questions with their answers, drawn with `seed`."""
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    out = []
    while len(out) < n:
        op = rng.choice(sorted(OPERATIONS))
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        a, b = (a, b) if op == "+" or a >= b else (b, a)
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
