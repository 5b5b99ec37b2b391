"""Math datasets in the format verl and DAPO publish: DAPO's answer line (`Answer: 34`) scored by the accuracy
reward."""

import pytest

REASONING = "3x - 7 = 2x + 27, so x = 27 + 7.\n"


def test_accuracy_scores_an_answer_line_and_a_boxed_answer():
    pytest.importorskip("math_verify")
    from grpo_fast.train.tasks.rewards import accuracy_reward

    completions = [REASONING + "Answer: 34", "\\boxed{34}", REASONING + "Answer: 33"]
    assert accuracy_reward(completions, solution=["34"] * 3) == [1.0, 1.0, 0.0]


def test_accuracy_reads_the_last_answer_line_as_dapo_does():
    pytest.importorskip("math_verify")
    from grpo_fast.train.tasks.rewards import accuracy_reward

    scores = {
        # the last line that opens with "Answer:", over a box earlier in the reasoning
        "Is it \\boxed{12}? No: 34 - 12 = 22 is left.\nAnswer: 34": 1.0,
        "Answer: 34\nWait, 3x - 2x = x, and 27 - 7 = 20.\nAnswer: 20": 0.0,
        # the spellings models write it in
        "Answer:34": 1.0, "**Answer:** 34": 1.0, "Answer: **34**": 1.0, "answer: $34$": 1.0, "Answer:\n34": 1.0,
        "Answer: x = 34.": 1.0, "Final Answer: 34": 1.0,
        # an "Answer:" line with no answer on it leaves the rest of the text to be read
        "Answer: as shown below\n\\boxed{34}": 1.0, "Answer: none\n": 0.0,
    }
    completions = list(scores)
    assert dict(zip(completions, accuracy_reward(completions, solution=["34"] * len(completions)))) == scores
