"""Writes the local evaluation data of scripts/eval/tasks/ (committed; run again to check it is what it says): two-digit
additions as multiple-choice questions (4 choices: the sum, and sums off by 1, 10 and 11) and as questions to answer
in free text. No dataset can be downloaded here, and a task made of arithmetic has one right answer that a small
model gets right part of the time: enough to tell scoring that works from scoring that does not.

    python -m scripts.eval.arithmetic_task
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = Path(__file__).parent / "tasks"
SEED = 20261202


def questions(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        right = a + b
        wrong = [right + d for d in rng.sample([-11, -10, -1, 1, 10, 11], 3)]
        choices = [str(v) for v in [right] + wrong]
        rng.shuffle(choices)
        rows.append({"question": f"What is {a} + {b}?", "choices": choices, "answer": choices.index(str(right)),
                     "sum": str(right)})
    return rows


def main() -> None:
    rng = random.Random(SEED)
    for split, count in (("train", 8), ("test", 200)):
        path = TASKS / f"arithmetic_{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in questions(count, rng)))
        print(f"wrote {path} ({count} questions)")


if __name__ == "__main__":
    main()
