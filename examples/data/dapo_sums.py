"""Writes dapo_sums.parquet: sums of two numbers below 20 in the columns and prompt template of DAPO-Math-17k
(`prompt` a list of chat messages, the answer at `reward_model.ground_truth`), for trying the DAPO recipe on a small
model and a CPU (examples/dapo_smollm2_cpu.yaml): SmolLM2-135M-Instruct answers some of them and misses others, so
groups differ in accuracy and dynamic sampling has something to filter.

    python examples/data/dapo_sums.py          # the same 256 rows every time (seed 0)
"""

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

# DAPO-Math-17k's prompt template around each problem
TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\nRemember to "
            "put your answer on its own line after \"Answer:\".")


def rows(count: int = 256, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randrange(20), rng.randrange(20)
        out.append({"data_source": "sums", "prompt": [{"role": "user", "content": TEMPLATE.format(
            problem=f"What is {a} + {b}?")}], "ability": "MATH",
            "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(index)}})
    return out


def write(path: str) -> None:
    pq.write_table(pa.Table.from_pylist(rows()), path)


if __name__ == "__main__":
    write(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dapo_sums.parquet"))
