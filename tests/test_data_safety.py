"""Data safety as a property: every command, run to success in a project folder of the user's, changes no file
that existed before outside its output directory, and removes only the work directories it created.

The refusals (an output that is, contains or lies inside an input; ``--overwrite`` of anything but a previous
retrofitter output; a work directory holding the user's files) are rows of tests/test_failure_modes.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from retrofitter.cli import main
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir

TINY = ["--seq-len", "32", "--quiet"]
LINEARIZE = ["--transfer-mode", "blockwise", "--transfer-tokens", "64", "--lora-tokens", "32", "--feature-dim", "4",
             "--window", "8", "--batch-size", "1"]


def _digest(root: Path, skip: Path | None = None) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and (skip is None or skip not in p.parents)}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder: a model, a corpus, notes, photos, an empty folder; the working directory."""
    save_tiny_model_dir(tmp_path / "model", "llama")
    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 3)
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(bytes(range(256)))
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _compress(out: str, *extra: str) -> list[str]:
    return ["compress", "model", "--ratio", "0.3", "--calib", "corpus.txt", "--calib-samples", "4", "--out", out,
            "--eval", "corpus.txt", "--max-eval-tokens", "64", *extra, *TINY]


def _run_and_check(project: Path, argv: list[str], out: str | None) -> None:
    before = _digest(project)
    dirs_before = {p for p in project.rglob("*") if p.is_dir()}
    assert main(argv) == 0
    out_path = project / out if out else None
    after = _digest(project, skip=out_path)
    assert {k: v for k, v in before.items() if out is None or not k.startswith(f"{out}/")} == {
        k: v for k, v in after.items() if k in before}  # nothing the user had changed or vanished
    leftovers = {p.name for p in project.iterdir()} - {p.name for p in dirs_before} - {
        Path(k).parts[0] for k in before} - {out}
    assert leftovers <= {"r.json"}, leftovers  # no work directory, lock or temporary left behind
    assert (project / "empty").is_dir() and not any((project / "empty").iterdir())


@pytest.mark.parametrize("case", ["compress", "mla", "linearize, new work dir", "linearize, empty work dir of the user's",
                                  "eval --json", "report"])
def test_a_successful_command_changes_nothing_of_the_user(project, case):
    argv, out = {
        "compress": (_compress("out", "--json", "r.json"), "out"),
        "mla": (["mla", "model", "--kv-ratio", "0.5", "--calib", "corpus.txt", "--calib-samples", "4", "--out", "mla",
                 "--eval", "corpus.txt", "--max-eval-tokens", "64", "--json", "r.json", *TINY], "mla"),
        "linearize, new work dir": (["linearize", "model", "--train-corpus", "corpus.txt", *LINEARIZE, "--work-dir",
                                     "scratch", "--out", "lin", "--no-eval", *TINY], "lin"),
        "linearize, empty work dir of the user's": (["linearize", "model", "--train-corpus", "corpus.txt", *LINEARIZE,
                                                     "--work-dir", "empty", "--out", "lin", "--no-eval", *TINY], "lin"),
        "eval --json": (["eval", "model", "--ppl", "corpus.txt", "--max-eval-tokens", "64", "--json", "r.json",
                         *TINY], None),
        "report": (None, "rep"),
    }[case]
    if case == "report":
        assert main(["eval", "model", "--ppl", "corpus.txt", "--max-eval-tokens", "64", "--json", "r.json",
                     *TINY]) == 0
        argv = ["report", "r.json", "--out", "rep"]
    _run_and_check(project, argv, out)
    assert not (project / "scratch").exists()  # the work directory it created is gone
    if case == "mla":
        record = json.loads((project / "r.json").read_text())
        assert record["method"] == "mla" and record["mla"]["kv_fraction"] == 0.5
        assert record["kv_bytes_per_token"] == 2 * 16 * 4  # 2 layers x (r + 2m = 16 numbers) x fp32


def test_heal_and_overwrite_replace_only_a_previous_output_and_say_so(project, caplog):
    assert main(_compress("out")) == 0
    heal = ["heal", "out", "--tokens", "64", "--train-corpus", "corpus.txt", "--out", "healed", "--no-eval", *TINY]
    _run_and_check(project, heal, "healed")
    logging.getLogger("retrofitter.preflight").disabled = False  # a dictConfig of another test's library may disable it
    with caplog.at_level(logging.WARNING, logger="retrofitter"):
        _run_and_check(project, [*heal, "--overwrite"], "healed")
    assert any("replaced" in r.getMessage() and "healed" in r.getMessage() for r in caplog.records)
    assert json.loads((project / "healed" / "retrofitter.json").read_text())["heal"]["tokens"] > 0
