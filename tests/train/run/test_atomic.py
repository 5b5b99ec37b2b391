"""The one folder writer (grpo_fast.train.run.atomic): a folder is written whole or not at all."""

import os

import pytest

from grpo_fast.train.run.atomic import atomic_folder


def test_a_clean_block_replaces_the_folder_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "checkpoint-1"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_folder(str(target), replace=True) as temporary:
        assert temporary == str(target) + ".tmp" and os.listdir(temporary) == []
        (tmp_path / "checkpoint-1.tmp" / "new.txt").write_text("new")
        assert (target / "old.txt").exists()            # untouched until the block ends
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_failed_block_keeps_the_old_folder_whole(tmp_path, failure):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("good")
    with pytest.raises(type(failure)):
        with atomic_folder(str(target), replace=True) as temporary:
            (tmp_path / "model.tmp" / "weights").write_text("half")
            assert os.path.isdir(temporary)
            raise failure
    assert (target / "weights").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_without_replace_an_existing_folder_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_folder(str(tmp_path / "out")):
            raise AssertionError("the block must not run")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    with atomic_folder(str(tmp_path / "fresh/")) as temporary:      # a trailing slash names the same folder
        open(os.path.join(temporary, "a"), "w").close()
    assert os.listdir(tmp_path / "fresh") == ["a"]
