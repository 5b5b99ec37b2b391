"""Math datasets in the format verl and DAPO publish (DAPO-Math-17k, verl's preprocessed parquet files): a chat
`prompt` list and the gold answer at `reward_model.ground_truth`, read through a dotted solution_column; and
DAPO's answer line (`Answer: 34`) scored by the accuracy reward.

examples/data/dapo_math_sample.parquet holds SAMPLE_ROWS; write_sample rewrites it."""

import json
import os

import pytest

from grpo_fast.train.tasks import check_data_identity, data_identity, dataset_files, load_task, prompt_text
from grpo_fast.train.tasks.config import DataConfig, EvaluationConfig

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SAMPLE = os.path.join(ROOT, "examples", "data", "dapo_math_sample.parquet")
ANSWER = "reward_model.ground_truth"

# DAPO-Math-17k's prompt: the problem inside its instructions to end with a line "Answer: ..."
TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
            "your answer on its own line after \"Answer:\".")
PROBLEMS = [("If 3x - 7 = 2x + 27, what is x?", "34"),
            ("What is the sum of the first 10 positive odd integers?", "100"),
            ("How many positive divisors does 36 have?", "9"),
            ("Find the remainder when 2^10 is divided by 7.", "2"),
            ("A rectangle has perimeter 34 and one side of length 5. What is its area?", "60"),
            ("What is the smallest positive integer n such that n! is divisible by 1000?", "15"),
            ("Compute 17^2 - 13^2.", "120"),
            ("In how many ways can 3 books be chosen from 7 different books?", "35")]
SAMPLE_ROWS = [{"data_source": "math_dapo",
                "prompt": [{"content": TEMPLATE.format(problem), "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"sample-{number:04d}"}}
               for number, (problem, answer) in enumerate(PROBLEMS)]
SCHEMA = pa.schema([("data_source", pa.string()),
                    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
                    ("ability", pa.string()),
                    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                    ("extra_info", pa.struct([("index", pa.string())]))])


def write_sample(path, rows=SAMPLE_ROWS, schema=SCHEMA) -> str:
    """Writes `rows` as a parquet file of DAPO-Math-17k's columns (schema None: pyarrow infers one)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return str(path)


def expected_samples(rows=SAMPLE_ROWS) -> list:
    return [{"prompt": [{"role": "user", "content": row["prompt"][0]["content"]}],
             "solution": row["reward_model"]["ground_truth"]} for row in rows]


def test_the_committed_sample_holds_the_rows_written_here():
    table = pq.read_table(SAMPLE)
    assert table.schema.remove_metadata() == SCHEMA
    assert table.to_pylist() == SAMPLE_ROWS


def test_a_dapo_parquet_file_loads_as_published(tmp_path):
    path = write_sample(tmp_path / "dapo-math-17k.parquet")
    assert dataset_files.load_samples(path, solution_column=ANSWER) == expected_samples()
    # the other columns reached by path too (prompt_column is symmetric)
    assert [s["prompt"] for s in dataset_files.load_samples(path, prompt_column="extra_info.index",
                                                            solution_column=ANSWER)][:2] == ["sample-0000",
                                                                                             "sample-0001"]


@pytest.mark.parametrize("kind", ["jsonl", "save_to_disk Dataset"])
def test_the_same_rows_in_json_lines_or_a_save_to_disk_folder(tmp_path, kind):
    if kind == "jsonl":
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in SAMPLE_ROWS))
    else:
        path = tmp_path / "folder"
        datasets.Dataset.from_list(SAMPLE_ROWS).save_to_disk(str(path))
    assert dataset_files.load_samples(str(path), solution_column=ANSWER) == expected_samples()


def test_a_nested_json_number_keeps_the_digits_the_file_writes(tmp_path):
    rows = [dict(SAMPLE_ROWS[0], reward_model={"ground_truth": 2**53 + 1}),
            dict(SAMPLE_ROWS[1], reward_model={"ground_truth": 4.0})]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [s["solution"] for s in dataset_files.load_samples(str(path), solution_column=ANSWER)] == [
        "9007199254740993", "4"]


def test_a_column_named_with_dots_is_read_as_it_is(tmp_path):
    # a flattened table (pandas.json_normalize) names its columns reward_model.ground_truth: that column wins
    rows = [{"prompt": "1+1?", "reward_model.ground_truth": "2", "reward_model": {"ground_truth": "wrong"}}]
    path = write_sample(tmp_path / "flat.parquet", rows, schema=None)
    assert dataset_files.load_samples(path, solution_column=ANSWER) == [{"prompt": "1+1?", "solution": "2"}]


def bad(row: int, **changes) -> list:
    return [dict(r, **changes) if i == row else r for i, r in enumerate(SAMPLE_ROWS[:3])]


@pytest.mark.parametrize("rows, column, row, message", [
    (bad(1, reward_model={"answer": "100", "style": "x"}), ANSWER, 1,
     "column 'reward_model.ground_truth' (solution_column): no key 'ground_truth' in 'reward_model'; keys found: "
     "['answer', 'style']"),
    (bad(0, reward_model="34"), ANSWER, 0,
     "column 'reward_model.ground_truth' (solution_column): expected 'reward_model' to be a struct (a dict of keys) "
     "holding 'ground_truth', got str '34'"),
    (bad(2, reward_model={"ground_truth": ["9"], "style": "x"}), ANSWER, 2,
     "column 'reward_model.ground_truth' (solution_column): expected text or a number, got list"),
    (bad(2, reward_model={"ground_truth": True, "style": "x"}), ANSWER, 2,
     "column 'reward_model.ground_truth' (solution_column): expected text or a number, got bool"),
    (bad(1, reward_model=None), ANSWER, 1,
     "column 'reward_model.ground_truth' (solution_column): empty solution (null or missing)"),
    (bad(1, reward_model={"ground_truth": " ", "style": "x"}), ANSWER, 1,
     "column 'reward_model.ground_truth' (solution_column): empty solution (' ')"),
    (SAMPLE_ROWS[:2], "reward_model", 0,
     "column 'reward_model' (solution_column): expected text or a number, got a struct with keys ['ground_truth', "
     "'style']; name one with a dotted path, e.g. reward_model.ground_truth"),
    (SAMPLE_ROWS[:2], "reward_model.ground_truth.value", 0,
     "column 'reward_model.ground_truth.value' (solution_column): expected 'reward_model.ground_truth' to be a "
     "struct (a dict of keys) holding 'value', got str '34'"),
])
def test_a_path_that_finds_no_answer_says_what_it_found_in_one_line(tmp_path, rows, column, row, message):
    # JSON Lines: each row as it is written (parquet gives every row the same struct keys)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as error:
        dataset_files.load_samples(str(path), solution_column=column)
    assert str(error.value) == f"{path}: row {row} (line {row + 1}), {message}"


def test_a_missing_column_names_the_path_and_the_columns_found(tmp_path):
    path = write_sample(tmp_path / "data.parquet")
    with pytest.raises(ValueError) as error:
        dataset_files.load_samples(path, solution_column="reward.ground_truth")
    assert str(error.value) == (f"{path}: no column 'reward.ground_truth' (solution_column); columns found: "
                                "['data_source', 'prompt', 'ability', 'reward_model', 'extra_info']")


@pytest.mark.parametrize("rows, column, message", [
    ([dict(row, reward_model={"answer": "1", "style": "x"}) for row in SAMPLE_ROWS[:2]], ANSWER,
     "row 0, column 'reward_model.ground_truth' (solution_column): no key 'ground_truth' in 'reward_model'; "
     "keys found: ['answer', 'style']"),
    (SAMPLE_ROWS[:2], "reward_model",
     "row 0, column 'reward_model' (solution_column): expected text or a number, got a struct with keys "
     "['ground_truth', 'style']"),
    (SAMPLE_ROWS[:2], "prompt.content",
     "row 0, column 'prompt.content' (solution_column): expected 'prompt' to be a struct (a dict of keys) holding "
     "'content', got list"),
])
def test_the_same_errors_from_parquet(tmp_path, rows, column, message):
    # parquet gives every row of a struct column the same keys: a key no row has is missing from the first row
    path = write_sample(tmp_path / "data.parquet", rows, schema=None)
    with pytest.raises(ValueError) as error:
        dataset_files.load_samples(path, solution_column=column)
    assert str(error.value).startswith(f"{path}: {message}")


def test_a_prompt_path_that_ends_on_a_struct_names_its_keys(tmp_path):
    path = write_sample(tmp_path / "data.parquet")
    with pytest.raises(ValueError, match=r"row 0, column 'extra_info' \(prompt_column\): expected text or a list of "
                                         r"chat messages, got a struct with keys \['index'\]; name one with a "
                                         r"dotted path, e.g. extra_info.index$"):
        dataset_files.load_samples(path, prompt_column="extra_info", solution_column=ANSWER)


@pytest.mark.parametrize("column", ["", " ", "reward_model.", ".ground_truth", "reward_model..ground_truth"])
def test_the_config_refuses_a_path_with_an_empty_part(column):
    for name in ("solution_column", "prompt_column"):
        with pytest.raises(ValueError, match=rf"^{name}={column!r}: expected a column name or a dotted path into "
                                             r"struct columns such as reward_model.ground_truth, with no empty part$"):
            DataConfig(**{name: column})


def test_held_out_problems_and_the_resume_check_read_the_same_path(tmp_path):
    train = write_sample(tmp_path / "train.parquet", SAMPLE_ROWS[:6])
    test = write_sample(tmp_path / "test.parquet", SAMPLE_ROWS[6:])
    data = DataConfig(task=train, solution_column=ANSWER)
    # a share of the task held out (eval_fraction): both parts are the file's problems with their answers
    samples, held_out = load_task(data, EvaluationConfig(eval_fraction=0.5), seed=0)
    assert len(held_out) == 3
    assert sorted(map(str, samples + held_out)) == sorted(map(str, expected_samples(SAMPLE_ROWS[:6])))
    # a second file held out (eval_task), as verl's train.parquet and test.parquet
    evaluation = EvaluationConfig(eval_task=test)
    samples, held_out = load_task(data, evaluation, seed=0)
    assert (samples, held_out) == (expected_samples(SAMPLE_ROWS[:6]), expected_samples(SAMPLE_ROWS[6:]))
    # a resume compares the data: the same files are the same data; a changed answer in either is a change
    identity = data_identity(samples, held_out)
    assert check_data_identity(identity, data_identity(*load_task(data, evaluation, seed=0)), train) is None
    for path, rows, change in ((train, SAMPLE_ROWS[:6], "training rows changed"),
                               (test, SAMPLE_ROWS[6:], "the held-out problems' solutions changed")):
        write_sample(path, [dict(rows[0], reward_model={"ground_truth": "10", "style": "x"}), *rows[1:]])
        with pytest.raises(ValueError, match=change):
            check_data_identity(identity, data_identity(*load_task(data, evaluation, seed=0)), train)
        write_sample(path, rows)


def test_the_chat_prompt_is_rendered_with_the_chat_template():
    class Template:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return json.dumps(messages)

    sample = dataset_files.load_samples(SAMPLE, solution_column=ANSWER)[0]
    text = prompt_text(sample, Template(), DataConfig(system_prompt="Think step by step."))
    assert json.loads(text) == [{"role": "system", "content": "Think step by step."}, *sample["prompt"]]


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
