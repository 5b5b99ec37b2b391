"""Dataset files and save_to_disk folders read through Hugging Face datasets: every format gives the same samples,
and every unusable input gives one ValueError naming the file, the row and the column."""

import csv
import json
import os
import subprocess
import sys

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from grpo_fast.train.tasks import dataset_files  # noqa: E402

# Solutions a careless reader would mangle: "007" -> 7, "3.50" -> 3.5, "None" -> a missing value.
SAMPLES = [{"prompt": "What is 2+3?", "solution": "5"}, {"prompt": "Agent number?", "solution": "007"},
           {"prompt": "Price, with cents?", "solution": "3.50"}, {"prompt": "Which of these?", "solution": "None"},
           {"prompt": "Ünïcode: ∑ of 1..3 = ?", "solution": "6"}]
MESSAGES = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "solution": "2"},
            {"prompt": [{"role": "user", "content": "2*3?"}], "solution": "6"}]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return str(path)


def write_json(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    return str(path)


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_folder(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


WRITERS = {
    "jsonl": lambda d, rows: write_jsonl(d / "data.jsonl", rows),
    "json array": lambda d, rows: write_json(d / "data.json", rows),
    "json lines in .json": lambda d, rows: write_jsonl(d / "data.json", rows),
    "parquet": lambda d, rows: write_parquet(d / "data.parquet", rows),
    "csv": lambda d, rows: write_csv(d / "data.csv", rows),
    "save_to_disk Dataset": lambda d, rows: write_folder(d / "folder", rows),
}


@pytest.mark.parametrize("kind", WRITERS)
def test_every_format_round_trips_the_samples(tmp_path, kind):
    path = WRITERS[kind](tmp_path, SAMPLES)
    dataset_files.check_source(path, "task")
    assert dataset_files.load_samples(path) == SAMPLES
    assert dataset_files.load_samples(path, split="train") == SAMPLES
    assert dataset_files.splits(path) == ["train"]


def test_dataset_dict_folder_selects_the_split(tmp_path):
    train, test = SAMPLES[:3], SAMPLES[3:]
    path = str(tmp_path / "dict")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(path)
    dataset_files.check_source(path, "task")
    assert sorted(dataset_files.splits(path)) == ["test", "train"]
    assert dataset_files.load_samples(path, split="train") == train
    assert dataset_files.load_samples(path, split="test") == test
    with pytest.raises(ValueError, match=r"dict: no split 'validation'; splits found: \['t"):
        dataset_files.load_samples(path, split="validation")
    with pytest.raises(ValueError, match="holds several splits; choose one of the splits found"):
        dataset_files.load_samples(path)
    only = str(tmp_path / "only")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(test)}).save_to_disk(only)
    assert dataset_files.load_samples(only) == test            # the one split, when none is named


def test_a_file_or_single_dataset_folder_has_only_the_train_split(tmp_path):
    for path in (write_jsonl(tmp_path / "a.jsonl", SAMPLES), write_folder(tmp_path / "folder", SAMPLES)):
        with pytest.raises(ValueError, match="the one split 'train', not 'test'"):
            dataset_files.load_samples(path, split="test")


@pytest.mark.parametrize("kind", ["jsonl", "json array", "parquet", "save_to_disk Dataset"])
def test_messages_column_becomes_plain_role_content_dicts(tmp_path, kind):
    rows = [dict(row, prompt=[dict(m, name="x") for m in row["prompt"]]) for row in MESSAGES]   # extra key dropped
    assert dataset_files.load_samples(WRITERS[kind](tmp_path, rows)) == MESSAGES


def test_mixed_text_and_message_prompts_and_number_solutions_in_json(tmp_path):
    rows = [{"prompt": "1+1=", "solution": 2}, {"prompt": MESSAGES[1]["prompt"], "solution": 2.5},
            {"prompt": "4/2=", "solution": 2.0}]
    path = tmp_path / "a.jsonl"
    path.write_text("\n\n".join(json.dumps(row) for row in rows))       # blank lines between, no final newline
    assert dataset_files.load_samples(str(path)) == [
        {"prompt": "1+1=", "solution": "2"}, {"prompt": MESSAGES[1]["prompt"], "solution": "2.5"},
        {"prompt": "4/2=", "solution": "2"}]


def test_integral_floats_render_as_integers(tmp_path):
    path = write_parquet(tmp_path / "f.parquet", [{"prompt": "a", "solution": 42.0}, {"prompt": "b", "solution": 2.5},
                                                  {"prompt": "c", "solution": 7}])
    assert [s["solution"] for s in dataset_files.load_samples(path)] == ["42", "2.5", "7"]


@pytest.mark.parametrize("kind", ["jsonl", "json array", "csv"])
def test_answers_keep_the_text_the_file_writes(tmp_path, kind):
    # a column mixing ints and floats goes through float64 in datasets: 2**53 + 1 would read as 2**53
    rows = [{"prompt": "a", "solution": 2**53 + 1}, {"prompt": "b", "solution": 2.5},
            {"prompt": "c", "solution": 12345678901234567890123}, {"prompt": "d", "solution": 4.0}]
    path = WRITERS[kind](tmp_path, rows)
    assert [s["solution"] for s in dataset_files.load_samples(path)] == [
        "9007199254740993", "2.5", "12345678901234567890123", "4.0" if kind == "csv" else "4"]
    path = write_parquet(tmp_path / "ints.parquet", [{"prompt": "a", "solution": 2**53 + 1},
                                                     {"prompt": "b", "solution": -(2**62)}])
    assert [s["solution"] for s in dataset_files.load_samples(path)] == ["9007199254740993", str(-(2**62))]


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "save_to_disk Dataset"])
def test_custom_column_names(tmp_path, kind):
    rows = [{"question": s["prompt"], "answer": s["solution"], "other": "x"} for s in SAMPLES]
    path = WRITERS[kind](tmp_path, rows)
    assert dataset_files.load_samples(path, prompt_column="question", solution_column="answer") == SAMPLES


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet", "save_to_disk Dataset"])
def test_missing_column_names_it_its_key_and_the_columns_found(tmp_path, kind):
    path = WRITERS[kind](tmp_path, [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError) as error:
        dataset_files.load_samples(path)
    name = os.path.basename(path)
    assert f"{name}: no column 'prompt' (prompt_column); columns found: ['question', 'answer']" in str(error.value)
    with pytest.raises(ValueError, match=r"no column 'solution' \(solution_column\); columns found: \['question'"):
        dataset_files.load_samples(path, prompt_column="question")


@pytest.mark.parametrize("row, column, words", [
    ({"prompt": "   ", "solution": "1"}, "'prompt' (prompt_column)", "empty prompt ('   ')"),
    ({"prompt": None, "solution": "1"}, "'prompt' (prompt_column)", "empty prompt (null or missing)"),
    ({"solution": "1"}, "'prompt' (prompt_column)", "empty prompt (null or missing)"),
    ({"prompt": [], "solution": "1"}, "'prompt' (prompt_column)", "empty prompt (an empty list of messages)"),
    ({"prompt": "q", "solution": None}, "'solution' (solution_column)", "empty solution (null or missing)"),
    ({"prompt": "q", "solution": ""}, "'solution' (solution_column)", "empty solution ('')"),
    ({"prompt": "q", "solution": True}, "'solution' (solution_column)", "expected text or a number, got bool"),
    ({"prompt": "q", "solution": [1]}, "'solution' (solution_column)", "expected text or a number, got list"),
    ({"prompt": 5, "solution": "1"}, "'prompt' (prompt_column)", "expected text or a list of chat messages, got int"),
    ({"prompt": [{"role": "user"}], "solution": "1"}, "'prompt' (prompt_column)", "message 0 is not a"),
])
def test_bad_row_names_file_row_line_and_column(tmp_path, row, column, words):
    rows = SAMPLES[:3] + [row]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:])
                    + "\n\n")        # blank lines: rows and lines differ (and datasets stumbles on mixed types)
    with pytest.raises(ValueError) as error:
        dataset_files.load_samples(str(path))
    assert f"data.jsonl: row 3 (line 5), column {column}: {words}" in str(error.value)


def test_empty_csv_cell_names_the_row(tmp_path):
    path = write_csv(tmp_path / "data.csv", SAMPLES[:2] + [{"prompt": "q", "solution": ""}])
    with pytest.raises(ValueError, match=r"data.csv: row 2, column 'solution' \(solution_column\): empty solution"):
        dataset_files.load_samples(path)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv"])
def test_non_utf8_text_names_the_byte_and_line(tmp_path, name):
    path = tmp_path / name
    good = b"prompt,solution\n" if name.endswith(".csv") else b'{"prompt": "a", "solution": "1"}\n'
    bad = b"caf\xe9,1\n" if name.endswith(".csv") else b'{"prompt": "caf\xe9", "solution": "1"}\n'
    path.write_bytes(good + bad)
    with pytest.raises(ValueError, match=rf"{name}: not UTF-8 text \(invalid continuation byte at byte "
                                         rf"{len(good) + bad.index(0xE9)}, line 2\)"):
        dataset_files.load_samples(str(path))


@pytest.mark.parametrize("name, content, message", [
    ("data.jsonl", '{"prompt": "a", "solution": "1"}\n{"prompt": "b", "solution": 2\n',
     r"data.jsonl:2: not JSON \(Expecting ',' delimiter at column 30\)$"),
    ("data.jsonl", '{"prompt": "a", "solution": "1"}\n[1, 2]\n', r"data.jsonl:2: expected a JSON object, got list"),
    ("data.json", '[\n{"prompt": "a", "solution": "1"},\n{"prompt": "b"\n]', r"data.json:4: not JSON \(Expecting"),
    ("data.json", '[{"prompt": "a", "solution": "1"}, "text"]', "item 1 of the array is a str, not a JSON object"),
    ("data.json", '{\n"prompt": "a", "solution": "1"\n}', r"data.json:1: not JSON .*a .json file holds a JSON array"),
    ("data.csv", "prompt,solution\na,1\nb,2,3\n", r"data.csv: cannot read as CSV \(ParserError: .*Expected 2 fields"),
    ("data.parquet", "not parquet", r"data.parquet: cannot read as Parquet \(ArrowInvalid: Parquet magic bytes"),
])
def test_unparsable_file_names_it_in_one_line(tmp_path, capfd, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        dataset_files.load_samples(str(tmp_path / name))
    assert "\n" not in str(error.value)
    assert "Failed to read" not in capfd.readouterr().err       # datasets' own logged copy is hidden


@pytest.mark.parametrize("name, content", [("a.jsonl", ""), ("a.jsonl", "\n  \n"), ("a.json", "[]"),
                                           ("a.csv", "prompt,solution\n"), ("a.csv", "")])
def test_no_rows(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=rf"{name}: no rows"):
        dataset_files.load_samples(str(tmp_path / name))


def test_no_rows_in_parquet_or_folder(tmp_path):
    empty = pa.table({"prompt": pa.array([], pa.string()), "solution": pa.array([], pa.string())})
    pq.write_table(empty, tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"prompt": [], "solution": []},
                               features=datasets.Features({"prompt": datasets.Value("string"),
                                                           "solution": datasets.Value("string")})
                               ).save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SAMPLES), "test": datasets.Dataset.from_dict(
        {"prompt": [], "solution": []})}).save_to_disk(str(tmp_path / "dict"))
    assert dataset_files.load_samples(str(tmp_path / "dict"), split="train") == SAMPLES   # the empty split unread
    for path in (tmp_path / "a.parquet", tmp_path / "folder", tmp_path / "dict"):
        with pytest.raises(ValueError, match="no rows"):
            dataset_files.load_samples(str(path), split="test" if path.name == "dict" else None)


def test_check_source_says_why(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "plain").mkdir()
    cases = {str(tmp_path / "missing.jsonl"): "no such file or folder",
             str(tmp_path / "notes.txt"): "unsupported suffix; supported: .jsonl, .json, .parquet, .csv",
             str(tmp_path / "plain"): "is a folder but not one written by datasets' save_to_disk"}
    for path, why in cases.items():
        with pytest.raises(ValueError) as error:
            dataset_files.check_source(path, "eval_task")
        assert str(error.value).startswith(f"eval_task={path!r}: {why}")
        with pytest.raises(ValueError, match="no such file|unsupported suffix|not one written"):
            dataset_files.load_samples(path)
    dataset_files.check_source(write_jsonl(tmp_path / "UPPER.JSONL", SAMPLES), "task")


def test_module_import_does_not_import_datasets():
    path = dataset_files.__file__
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('dataset_files', {path!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "assert 'datasets' not in sys.modules and 'pyarrow' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nothing_is_left_in_the_datasets_cache_or_temp(tmp_path, monkeypatch):
    # datasets reads its cache paths from the environment at import, so its config attributes are patched too.
    paths = {}
    for kind, write in WRITERS.items():
        (tmp_path / kind).mkdir()
        paths[kind] = write(tmp_path / kind, SAMPLES)
    bad = write_csv(tmp_path / "bad.csv", [{"prompt": "q", "solution": ""}])
    cache, temp = tmp_path / "hf", tmp_path / "tmp"
    cache.mkdir()
    temp.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    for name in ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH", "HF_MODULES_CACHE"):
        monkeypatch.setattr(datasets.config, name, cache / name.lower())
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    for kind, path in paths.items():
        assert dataset_files.load_samples(path) == SAMPLES, kind
    with pytest.raises(ValueError, match="empty solution"):
        dataset_files.load_samples(bad)
    assert list(cache.rglob("*")) == [] and list(temp.rglob("*")) == []


def test_logging_and_progress_bars_are_restored(tmp_path):
    verbosity = datasets.utils.logging.get_verbosity()
    bars_off = datasets.utils.are_progress_bars_disabled()
    with pytest.raises(ValueError):
        dataset_files.load_samples(write_csv(tmp_path / "a.csv", [{"prompt": "", "solution": "1"}]))
    assert datasets.utils.logging.get_verbosity() == verbosity
    assert datasets.utils.are_progress_bars_disabled() == bars_off
