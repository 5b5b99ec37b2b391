"""The public API as a type checker and an IDE see it: mypy on tests/typing/public_api.py reports exactly the
errors its lines mark (`# error: <words>`: a misspelt keyword, an option group in another's place) and nothing
else, so the entries' signatures survive their decorator (a ParamSpec one) and the package ships py.typed."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS = os.path.join("tests", "typing", "public_api.py")


def test_mypy_sees_the_entries_signatures(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "--follow-imports=silent", "--python-version", "3.11", "--no-error-summary",
                           "--hide-error-context", CALLS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    reported = {}
    for line in done.stdout.splitlines():
        match = re.match(rf"{re.escape(CALLS)}:(\d+): error: (.*)", line)
        if match:
            reported.setdefault(int(match[1]), []).append(match[2])
    with open(os.path.join(ROOT, CALLS)) as f:
        marked = {number: line.split("  # error: ", 1)[1].strip() for number, line in enumerate(f, 1)
                  if "  # error: " in line}
    assert len(marked) >= 7 and set(reported) == set(marked), (done.stdout[-3000:], done.stderr[-2000:])
    for number, words in marked.items():
        assert any(words in message for message in reported[number]), (number, words, reported[number])
    assert os.path.isfile(os.path.join(ROOT, "grpo_fast", "py.typed"))
