"""Work directories: taken only when new, empty or retrofitter's own; cleaned of retrofitter's own files only."""

from __future__ import annotations

import json

import pytest
import torch

from retrofitter.pipelines.resume import (WORK_MARKER, RunDirectory, UnsafeWorkDirError, check_work_dir,
                                          remove_work_dir)


def _fill(run: RunDirectory) -> None:
    run.save_tensors("layer_0", {"w": torch.ones(2)})
    run.save_progress({"layers_done": 1})


def test_a_new_directory_is_marked_as_created_and_removed_whole(tmp_path):
    run = RunDirectory(tmp_path / "work" / "rank0", "abc")
    _fill(run)
    assert json.loads((tmp_path / "work" / WORK_MARKER).read_text()) == {"created": True}
    assert remove_work_dir(tmp_path / "work") and not (tmp_path / "work").exists()


def test_an_empty_directory_of_the_user_is_emptied_but_kept(tmp_path):
    (tmp_path / "work").mkdir()
    run = RunDirectory(tmp_path / "work", "abc")
    _fill(run)
    assert json.loads((tmp_path / "work" / WORK_MARKER).read_text()) == {"created": False}
    assert not remove_work_dir(tmp_path / "work")
    assert (tmp_path / "work").is_dir() and list((tmp_path / "work").iterdir()) == []


def test_a_directory_with_other_files_is_refused_and_never_cleaned(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeWorkDirError, match="holds files retrofitter did not write .*notes.txt"):
        RunDirectory(tmp_path, "abc")
    with pytest.raises(UnsafeWorkDirError, match="--work-dir"):
        check_work_dir(tmp_path, "--work-dir")
    with pytest.raises(UnsafeWorkDirError, match="not a directory"):
        check_work_dir(tmp_path / "notes.txt")
    assert not remove_work_dir(tmp_path)  # unmarked: nothing is touched
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_files_added_by_someone_else_survive_the_cleanup(tmp_path):
    run = RunDirectory(tmp_path / "work", "abc")
    _fill(run)
    (tmp_path / "work" / "sub").mkdir()
    (tmp_path / "work" / "sub" / "keep.txt").write_text("not ours")
    run.remove()
    assert (tmp_path / "work" / "sub" / "keep.txt").read_text() == "not ours"
    assert sorted(p.name for p in (tmp_path / "work").rglob("*")) == ["keep.txt", "sub"]


def test_a_marked_directory_resumes_and_an_older_run_directory_is_still_recognised(tmp_path):
    run = RunDirectory(tmp_path / "work", "abc")
    _fill(run)
    assert RunDirectory(tmp_path / "work", "abc").load_progress() == {"layers_done": 1}
    (tmp_path / "work" / WORK_MARKER).unlink()  # as written before the marker existed: progress.json only
    check_work_dir(tmp_path / "work")
    assert not remove_work_dir(tmp_path / "work")  # not known to be created by retrofitter: kept, emptied
    assert list((tmp_path / "work").iterdir()) == []


def test_damaged_saved_work_is_named_with_what_to_do(tmp_path):
    run = RunDirectory(tmp_path / "work", "abc")
    _fill(run)
    (tmp_path / "work" / "layer_0.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match=r"layer_0.safetensors: the saved work cannot be read back .* delete"):
        run.load_tensors("layer_0")
    (tmp_path / "work" / "progress.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"progress.json: unreadable progress record .* to start over"):
        run.load_progress()
