"""benchmarks/tree_id.py: the git tree id of a copy of the repository without .git, as git computes it."""

import os
import shutil
import subprocess

import pytest

from grpo_fast.benchmarks.tree_id import tree_id

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone of this repository's HEAD and its tree id as git gives it."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs git and this repository's .git")
    path = tmp_path_factory.mktemp("clone") / "repo"
    git("clone", "-q", ROOT, str(path), cwd=ROOT)
    return path, git("rev-parse", "HEAD^{tree}", cwd=path)


def test_a_clean_copy_has_its_commits_tree_id(clone):
    path, expected = clone
    assert tree_id(path) == expected                         # its .git skipped


def test_ignored_and_carried_files_do_not_change_it_and_an_edit_does(clone, tmp_path):
    path, expected = clone
    copy = tmp_path / "copy"
    shutil.copytree(path, copy, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    (copy / "grpo_fast" / "__pycache__").mkdir()
    (copy / "grpo_fast" / "__pycache__" / "loss.cpython-311.pyc").write_bytes(b"\0")
    (copy / "wheels").mkdir()
    (copy / "wheels" / "trl.whl").write_bytes(b"")
    (copy / ".venv-latest" / "bin").mkdir(parents=True)
    (copy / ".venv-latest" / "bin" / "python").write_text("")
    (copy / "carried").mkdir()
    (copy / "carried" / "x.whl").write_bytes(b"")
    assert tree_id(copy, exclude=[copy / "carried"]) == expected
    assert tree_id(copy) != expected                         # the carried folder counts unless excluded
    os.chmod(copy / "README.md", 0o755)                      # the executable bit is part of the tree
    assert tree_id(copy, exclude=["carried"]) != expected
    os.chmod(copy / "README.md", 0o644)
    (copy / "README.md").write_text((copy / "README.md").read_text() + " ")
    assert tree_id(copy, exclude=["carried"]) != expected


def test_a_negated_ignore_pattern_is_refused(tmp_path):
    (tmp_path / ".gitignore").write_text("*.log\n!keep.log\n")
    with pytest.raises(ValueError, match="negated pattern '!keep.log'"):
        tree_id(tmp_path)
