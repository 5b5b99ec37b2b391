"""Training samples from dataset files (.jsonl, .json, .parquet, .csv) and from folders written by Hugging Face
datasets' save_to_disk, read through `datasets`, with errors that name the file, the row and the config key to change.

`datasets` is imported inside the functions only: config validation calls check_source and must stay cheap.
"""

from __future__ import annotations

import contextlib
import csv
import decimal
import io
import json
import math
import os
import tempfile

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
FORMATS = {".jsonl": "JSON Lines", ".json": "JSON", ".parquet": "Parquet", ".csv": "CSV"}


def _folder_kind(path: str) -> str | None:
    """"dict" for a save_to_disk DatasetDict folder, "dataset" for a Dataset one, None for any other folder (the
    files datasets.load_from_disk itself looks for)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "dict"
    if all(os.path.isfile(os.path.join(path, name)) for name in ("dataset_info.json", "state.json")):
        return "dataset"
    return None


def _problem(path: str) -> str | None:
    """None when `path` is a readable source, else why not (no data read)."""
    if os.path.isdir(path):
        if _folder_kind(path) is None:
            return ("is a folder but not one written by datasets' save_to_disk (it has neither dataset_dict.json nor "
                    "dataset_info.json and state.json)")
        return None
    if not os.path.isfile(path):
        return "no such file or folder"
    if os.path.splitext(path)[1].lower() not in SUFFIXES:
        return f"unsupported suffix; supported: {', '.join(SUFFIXES)}, or a save_to_disk folder"
    return None


def check_source(path: str, key: str) -> None:
    """None when `path` is an existing file with one of SUFFIXES or a save_to_disk folder; else raises a ValueError
    naming the config key `key`, the path and why. Reads no data."""
    problem = _problem(path)
    if problem:
        raise ValueError(f"{key}={path!r}: {problem}")


def splits(path: str) -> list[str]:
    """The split names of the save_to_disk DatasetDict folder at `path`; ["train"] for a file or a Dataset folder."""
    if os.path.isdir(path) and _folder_kind(path) == "dict":
        try:
            with open(os.path.join(path, "dataset_dict.json")) as f:
                return [str(name) for name in json.load(f)["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}: unreadable dataset_dict.json ({type(error).__name__}: {error})") from None
    return ["train"]


def load_samples(path: str, *, prompt_column: str = "prompt", solution_column: str = "solution",
                 split: str | None = None) -> list[dict]:
    """Samples [{"prompt": text or [{"role", "content"} messages], "solution": text}] of the file or save_to_disk
    folder at `path`; `split` picks a split of a DatasetDict folder (None: its only split) and must be None or "train"
    otherwise. A column name may be a dotted path into struct (dict) columns, as verl's parquet files keep the
    answer at reward_model.ground_truth (see column_path). Raises a ValueError naming the file (and row and column)
    on anything unusable."""
    problem = _problem(path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    import datasets

    # keep_in_memory plus a throwaway cache_dir: datasets builds its Arrow files from a data file in the temporary
    # folder (deleted on leaving it), so nothing is left in HF_DATASETS_CACHE; save_to_disk folders are memory-mapped.
    with _quiet(datasets), tempfile.TemporaryDirectory(prefix="grpo_fast_data_") as cache:
        if os.path.isdir(path):
            dataset, lines, rows = _load_folder(datasets, path, split), None, None
        elif split not in (None, "train"):
            raise ValueError(f"{path}: a file holds the one split 'train', not {split!r}")
        else:
            dataset, lines, rows = _load_file(datasets, path, cache, prompt_column, solution_column)
        return _samples(path, dataset, prompt_column, solution_column, lines, rows)


def _load_file(datasets, path: str, cache: str, prompt_column: str, solution_column: str):
    """(the datasets.Dataset of the data file, the line of each row for JSON Lines, else None, the rows as the file
    writes them for JSON and JSON Lines (numbers as JsonNumber), else None), read with `cache` as datasets'
    cache_dir; the text is checked first, as datasets reports bad bytes and bad JSON without a line."""
    suffix = os.path.splitext(path)[1].lower()
    source, lines, rows, options = path, None, None, {}
    if suffix == ".parquet":
        _check_parquet(path)
    else:
        text = _read_text(path)
        if not text.strip():
            raise ValueError(f"{path}: no rows (the file is empty)")
    if suffix == ".csv":
        # Every cell as text: the default parse would turn 007 into 7.0 and the answer "None" into a missing value.
        columns = _check_columns(path, _csv_header(path, text), prompt_column, solution_column)
        string = datasets.Value("string")
        options = {"features": datasets.Features({column: string for column, _ in columns}),
                   "keep_default_na": False, "na_values": [""]}
    elif suffix in (".jsonl", ".json"):
        # datasets reads a column mixing ints and floats as float64 (9007199254740993 -> ...992): the solutions
        # are taken from the file's own rows instead, numbers as written (see _solution)
        lines, rows = _check_json(path, text, array_allowed=suffix == ".json")
        from datasets.packaged_modules.json.json import JsonConfig

        # Recent datasets versions turn columns that look like agent traces into another schema: not wanted here.
        options = {"parse_agent_traces": False} if hasattr(JsonConfig, "parse_agent_traces") else {}
        if lines is None:
            # datasets reads a JSON array through pandas, which refuses an integer beyond 64 bits: it reads the
            # rows as JSON Lines instead
            copy = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in json.loads(text))
        else:
            copy = "".join(line + "\n" for line in text.split("\n") if line.strip())
        if copy != text:
            # Blank lines break datasets' handling of a column mixing types (text and messages, text and numbers),
            # so it reads a copy without them.
            source = os.path.join(cache, "rows.jsonl")
            with open(source, "w", encoding="utf-8") as f:
                f.write(copy)
    reader = {".parquet": datasets.Dataset.from_parquet, ".csv": datasets.Dataset.from_csv}.get(
        suffix, datasets.Dataset.from_json)
    try:
        return reader(source, cache_dir=cache, keep_in_memory=True, **options), lines, rows
    except Exception as error:  # datasets, pyarrow and pandas raise many kinds; keep one line of the cause
        raise _unreadable(path, FORMATS[suffix], error) from None


@contextlib.contextmanager
def _quiet(datasets):
    """Hides datasets' progress bars and the logged copies of errors that load_samples re-raises in one line."""
    bars_off, verbosity = datasets.utils.are_progress_bars_disabled(), datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if not bars_off:
            datasets.utils.enable_progress_bars()


def _unreadable(path: str, what: str, error: BaseException) -> ValueError:
    """A ValueError naming the file and the first line of the innermost cause of `error` (datasets wraps the
    parser's error in its own)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    line = (str(error).strip().splitlines() or [""])[0]
    return ValueError(f"{path}: cannot read as {what} ({type(error).__name__}: {line})")


def _load_folder(datasets, path: str, split: str | None):
    """The Dataset of `split` in the save_to_disk folder at `path` (memory-mapped: datasets writes nothing)."""
    names = splits(path)
    if _folder_kind(path) == "dict":
        if split is None and len(names) == 1:
            split = names[0]
        if split is None:
            raise ValueError(f"{path}: holds several splits; choose one of the splits found: {names}")
        if split not in names:
            raise ValueError(f"{path}: no split {split!r}; splits found: {names}")
        folder = os.path.join(path, split)         # only that split: another one may be unreadable, or large
    elif split not in (None, "train"):
        raise ValueError(f"{path}: a single-dataset folder holds the one split 'train', not {split!r}")
    else:
        folder = path
    try:
        return datasets.load_from_disk(folder)
    except Exception as error:
        if _no_data_files(folder):                  # datasets saves an empty Dataset but cannot load it back
            raise ValueError(f"{folder}: no rows") from None
        raise _unreadable(folder, "a save_to_disk folder", error) from None


def _no_data_files(folder: str) -> bool:
    """Whether the save_to_disk Dataset folder lists no Arrow files (its state.json says so)."""
    try:
        with open(os.path.join(folder, "state.json")) as f:
            return json.load(f).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def _read_text(path: str) -> str:
    """The UTF-8 text of the file (without a leading byte-order mark); bad bytes raise a ValueError naming their
    offset and line, which pyarrow and pandas would report cryptically."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}, line {line}); "
                         f"save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


class JsonNumber(str):
    """The text of a number in a JSON file, exactly as written (json's parse_int / parse_float hook)."""


def _json_rows(text: str):
    return json.loads(text, parse_int=JsonNumber, parse_float=JsonNumber)


def _check_json(path: str, text: str, array_allowed: bool) -> tuple[list[int] | None, list[dict]]:
    """(the line number of each row of JSON Lines `text`, None for a JSON array; the rows, numbers as JsonNumber
    text); raises a ValueError naming the line of a row that is not a JSON object."""
    if array_allowed and text.lstrip().startswith("["):
        try:
            rows = _json_rows(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{path}: item {index} of the array is a {_json_type(row)}, not a JSON object")
        if not rows:
            raise ValueError(f"{path}: no rows (an empty JSON array)")
        return None, rows
    hint = " (a .json file holds a JSON array of objects or one object per line)" if array_allowed else ""
    numbers, rows = [], []
    for number, line in enumerate(text.split("\n"), 1):   # not splitlines: JSON text may hold a raw U+2028
        if not line.strip():
            continue
        try:
            row = _json_rows(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg} at column {error.colno}){hint}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {_json_type(row)}{hint}")
        numbers.append(number)
        rows.append(row)
    return numbers, rows


def _json_type(value) -> str:
    """The Python type name json would give `value` (int or float for a number)."""
    if isinstance(value, JsonNumber):
        return "int" if value.lstrip("-").isdigit() else "float"
    return type(value).__name__


def _check_parquet(path: str) -> None:
    """Raises a ValueError when the Parquet file cannot be read or has no rows (which datasets fails on obscurely)."""
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_metadata(path).num_rows
    except Exception as error:
        raise _unreadable(path, "Parquet", error) from None
    if rows == 0:
        raise ValueError(f"{path}: no rows")


def _csv_header(path: str, text: str) -> list[str]:
    """The column names of CSV `text`; raises a ValueError when no row follows them."""
    try:
        rows = (row for row in csv.reader(io.StringIO(text)) if row)
        header, first = next(rows, None), next(rows, None)
    except csv.Error as error:
        raise ValueError(f"{path}: cannot read as CSV ({error})") from None
    if first is None:
        raise ValueError(f"{path}: no rows (only a header line)")
    return header


def column_path(name: str, found) -> tuple[str, tuple[str, ...]] | None:
    """(column, keys) that the config's column name `name` reads among the columns `found`: the column of that
    exact name with no keys, else the longest dotted prefix of `name` that is a column and the keys after it
    ("reward_model.ground_truth": the column reward_model, its key ground_truth); None when neither is a column."""
    if name in found:                   # a flat column whose name holds dots (a flattened table) is read as it is
        return name, ()
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        column = ".".join(parts[:cut])
        if column in found:
            return column, tuple(parts[cut:])
    return None


def _check_columns(path: str, found: list[str], prompt_column: str, solution_column: str) -> list[tuple]:
    """[(column, keys)] of prompt_column and solution_column (column_path); raises a ValueError naming the missing
    column, its config key and the columns found."""
    paths = []
    for column, key in ((prompt_column, "prompt_column"), (solution_column, "solution_column")):
        path_of = column_path(column, found)
        if path_of is None:
            raise ValueError(f"{path}: no column {column!r} ({key}); columns found: {list(found)}")
        paths.append(path_of)
    return paths


def _samples(path: str, dataset, prompt_column: str, solution_column: str, lines=None, rows=None) -> list[dict]:
    """The checked samples of a datasets.Dataset; `lines` (the line of each row) is named in errors when given;
    `rows` (the rows as the file writes them) give the solutions instead of the dataset's column when given."""
    (prompt_top, prompt_keys), (solution_top, solution_keys) = _check_columns(
        path, dataset.column_names, prompt_column, solution_column)
    if dataset.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    columns = dataset.with_format(None).select_columns(list(dict.fromkeys([prompt_top, solution_top]))).to_dict()
    solutions = columns[solution_top]
    if rows is not None and len(rows) == dataset.num_rows:
        solutions = [row.get(solution_top) for row in rows]
    samples = []
    for index, (prompt, solution) in enumerate(zip(columns[prompt_top], solutions)):
        row = f"{path}: row {index}" + (f" (line {lines[index]})" if lines else "")
        where = f"{row}, column {prompt_column!r} (prompt_column)"
        prompt = _prompt(_dig(prompt, prompt_top, prompt_keys, where), where, prompt_column)
        where = f"{row}, column {solution_column!r} (solution_column)"
        samples.append({"prompt": prompt,
                        "solution": _solution(_dig(solution, solution_top, solution_keys, where), where,
                                              solution_column)})
    return samples


def _dig(value, column: str, keys: tuple, where: str):
    """The value at `keys` inside `value`, the row's value of `column` (column_path); None when a struct on the way
    is null (the caller reports an empty value). Raises a ValueError naming the key and what was found instead of
    a struct, or the keys there are."""
    path = column
    for key in keys:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected {path!r} to be a struct (a dict of keys) holding {key!r}, got "
                             f"{type(value).__name__} {value!r:.80}")
        if key not in value:
            raise ValueError(f"{where}: no key {key!r} in {path!r}; keys found: {list(value)}")
        value, path = value[key], f"{path}.{key}"
    return value


def _got(value, column: str) -> str:
    """What a cell holds, for an error: its type, and for a struct its keys and the dotted path that reads one."""
    if isinstance(value, dict):
        keys = list(value)
        hint = f"; name one with a dotted path, e.g. {column}.{keys[0]}" if keys else ""
        return f"got a struct with keys {keys}{hint}"
    return f"got {type(value).__name__}"


def _prompt(value, where: str, column: str = "prompt"):
    """The prompt text, or the chat messages as plain {"role", "content"} dicts (other keys dropped); `column`, the
    config's prompt_column, is named in the hint of a struct's error."""
    if value is None or isinstance(value, str) and not value.strip():
        raise ValueError(f"{where}: empty prompt ({'null or missing' if value is None else repr(value)})")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected text or a list of chat messages, {_got(value, column)}")
    if not value:
        raise ValueError(f"{where}: empty prompt (an empty list of messages)")
    for number, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {number} is not a {{'role': text, 'content': text}} object, got "
                             f"{message!r:.100}")
    return [{"role": message["role"], "content": message["content"]} for message in value]


def _solution(value, where: str, column: str = "solution") -> str:
    """The gold answer as text: a string as is, a number by str() (an integral float such as 42.0 as "42"), a JSON
    number as written in the file (digits exact however many; 42.0 and 4.2e1 as "42", 3.50 as "3.50"); `column`,
    the config's solution_column, is named in the hint of a struct's error."""
    if isinstance(value, JsonNumber):
        number = decimal.Decimal(value)
        if number.is_finite() and number == number.to_integral_value() and abs(number.adjusted()) < 1000:
            return str(int(number))              # a whole number (not 1e100000, which int() would spell out)
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float, type(None))):
        raise ValueError(f"{where}: expected text or a number, {_got(value, column)}")
    if value is None or isinstance(value, float) and math.isnan(value) or isinstance(value, str) and not value.strip():
        raise ValueError(f"{where}: empty solution ({'null or missing' if value is None else repr(value)})")
    if isinstance(value, float):
        if math.isinf(value):
            raise ValueError(f"{where}: expected a finite number, got {value}")
        if value.is_integer():   # a whole number read as float (a JSON column mixing 1 and 2.5, a NaN-holding column)
            return str(int(value))
    return str(value)
