"""Bad input through the real CLI entry point: exit 2, one line on stderr naming the culprit, no traceback,
and nothing lost (existing files unchanged, no output or partial directories left behind).

The same table is docs/failure-modes.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from retrofitter.cli import main
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir

SRC = Path(__file__).parents[1] / "src"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model directory, a corpus, and the same model compressed once (read-only inputs of the cases)."""
    root = tmp_path_factory.mktemp("failure-modes")
    model_dir = save_tiny_model_dir(root / "tiny", "llama")
    corpus = root / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    compressed = root / "compressed"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test runs (conftest), so that the reruns below are bitwise comparable
    try:
        assert main(["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "4",
                     "--seq-len", "32", "--out", str(compressed), "--no-eval", "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    save_tiny_model_dir(root / "other-architecture", "qwen2")  # the same vocabulary, another family
    save_tiny_model_dir(root / "qwen3", "qwen3")  # q/k norms: no MLA form
    _smaller_vocabulary(_copy(model_dir, root / "other-vocabulary"))
    return root, model_dir, corpus, compressed


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _empty(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"")


def _json_of_wrong_shape(d: Path) -> None:
    (d / "retrofitter.json").write_text(json.dumps(["not", "an", "object"]))


def _edit_rank(d: Path) -> None:
    info = json.loads((d / "retrofitter.json").read_text())
    path, entry = next((p, e) for p, e in info["replacements"].items() if e["type"] == "LatentLinear")
    entry["spec"]["rank"] += 1
    (d / "retrofitter.json").write_text(json.dumps(info))


def _newer_format(d: Path) -> None:
    info = json.loads((d / "retrofitter.json").read_text())
    info["format_version"] = 99
    (d / "retrofitter.json").write_text(json.dumps(info))


def _nan_weight(d: Path) -> None:
    state = load_file(str(d / "model.safetensors"))
    key = next(k for k in state if k.endswith("q_proj.weight"))
    state[key][0, 0] = float("nan")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def _smaller_vocabulary(d: Path) -> None:
    """Embedding and head cut to 40 rows, config.json to match: the tokenizer (78 tokens) is now larger."""
    state = load_file(str(d / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        state[key] = state[key][:40].contiguous()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    config["vocab_size"] = 40
    (d / "config.json").write_text(json.dumps(config))


def _no_tokenizer(d: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)


def _pickle_only(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")  # never read: refused by its name


# (name, how the model directory is damaged (None: untouched), which model, command-line template, culprit)
# Template words: MODEL the model directory, CORPUS the corpus, OUT an output path that must not appear,
# HERE the test's working directory (it holds the model and other files of the user's), PHOTOS a folder of
# the user's, SUBDIR an empty folder, EMPTY / BINARY / LATIN1 corpora that cannot be read as text,
# OTHER_ARCH / OTHER_VOCAB models of another family / vocabulary.
CASES = [
    ("truncated weights", _truncate, "compressed", "eval MODEL --ppl CORPUS --seq-len 32", "model.safetensors"),
    ("empty weights", _empty, "original", "eval MODEL --ppl CORPUS --seq-len 32", "model.safetensors"),
    ("retrofitter.json of the wrong shape", _json_of_wrong_shape, "compressed", "eval MODEL --ppl CORPUS",
     "retrofitter.json: expected a JSON object"),
    ("rank edited in retrofitter.json", _edit_rank, "compressed", "eval MODEL --ppl CORPUS", "has shape"),
    ("newer format version", _newer_format, "compressed", "eval MODEL --ppl CORPUS", "newer retrofitter"),
    ("NaN weights at eval", _nan_weight, "original", "eval MODEL --ppl CORPUS --seq-len 32", "non-finite weights"),
    ("cuda on a CPU build", None, "original", "eval MODEL --ppl CORPUS --device cuda", "device 'cuda'"),
    ("damping NaN", None, "original", "compress MODEL --ratio 0.3 --damping nan --calib CORPUS --out OUT",
     "damping must be a finite number"),
    ("compressing a compressed model", None, "compressed",
     "compress MODEL --ratio 0.3 --calib CORPUS --calib-samples 4 --seq-len 32 --out OUT --no-eval",
     "converted before"),
    ("max-eval-tokens 0", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --max-eval-tokens 0", "max_eval_tokens (0)"),
    ("unknown eval corpus", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --eval NO_SUCH",
     "--eval 'NO_SUCH'"),
    ("eval batch size 0", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --eval-batch-size 0",
     "batch size must be >= 1"),
    ("unwritable --json", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --json FILE/r.json",
     "--json"),
    ("unwritable --out", None, "original", "linearize MODEL --out FILE/out --train-corpus CORPUS", "--out"),
    ("calib-samples 0", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --calib-samples 0 --out OUT",
     "--calib-samples must be >= 1"),
    ("missing local model", None, "original", "eval ./no/such/model --ppl CORPUS", "no such directory"),
    ("kv-ratio with a local method", None, "original",
     "compress MODEL --ratio 0.3 --kv-ratio 0.5 --calib CORPUS --out OUT",
     "kv_ratio (--kv-ratio) is an option of --method latentllm, not of asvd-rootcov"),
    ("kv-ratio without k and v", None, "original",
     "compress MODEL --ratio 0.3 --method latentllm --kv-ratio 0.5 --targets q,o --calib CORPUS --out OUT",
     "--targets must include k and v, got q,o"),
    ("latency budget with uniform ranks", None, "original",
     "compress MODEL --ratio 0.3 --budget latency --allocation uniform --calib CORPUS --out OUT",
     "use --allocation global"),
    ("out-of-core with global allocation", None, "original",
     "compress MODEL --ratio 0.3 --out-of-core --calib CORPUS --calib-samples 4 --seq-len 32 --out OUT",
     "--allocation uniform"),
    ("out-of-core with healing", None, "original",
     "compress MODEL --ratio 0.3 --out-of-core --allocation uniform --heal-tokens 64 --calib CORPUS --out OUT",
     "--heal-tokens needs the model in memory"),
    ("heal of a model that was never converted", None, "original", "heal MODEL --out OUT",
     "is not a saved retrofitter model"),
    # data safety: nothing of the user's is replaced or removed
    ("block-wise work dir holding the user's files", None, "original",
     "linearize MODEL --transfer-mode blockwise --train-corpus CORPUS --work-dir HERE --out OUT --no-eval",
     "contains the input MODEL"),
    ("block-wise work dir that is a folder of the user's", None, "original",
     "linearize MODEL --transfer-mode blockwise --train-corpus CORPUS --work-dir PHOTOS --out OUT --no-eval",
     "holds files retrofitter did not write"),
    ("work dir inside the input model", None, "original",
     "linearize MODEL --transfer-mode blockwise --train-corpus CORPUS --work-dir MODEL/work --out OUT --no-eval",
     "lies inside the input MODEL"),
    ("--out the input model, with --overwrite", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --out MODEL --overwrite --no-eval", "not a retrofitter output"),
    ("--out a compressed input, with --overwrite", None, "compressed",
     "linearize MODEL --train-corpus CORPUS --out MODEL --overwrite --no-eval", "is the input MODEL"),
    ("--out the folder holding the input, with --overwrite", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --out HERE --overwrite --no-eval", "not a retrofitter output"),
    ("--overwrite of a folder of photos", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --out PHOTOS --overwrite --no-eval", "not a retrofitter output"),
    ("--overwrite of a file", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --out FILE --overwrite --no-eval", "is a file, not a retrofitter"),
    ("--json inside the input model", None, "original", "eval MODEL --ppl CORPUS --seq-len 32 --json MODEL/config.json",
     "lies inside the input MODEL"),
    ("--json an existing directory", None, "original", "eval MODEL --ppl CORPUS --json SUBDIR", "--json"),
    ("--json a new directory", None, "original", "eval MODEL --ppl CORPUS --json newdir/", "is a directory"),
    ("--json a file that is not a results JSON", None, "original", "eval MODEL --ppl CORPUS --json FILE",
     "not a results JSON"),
    # corpora read before any work
    ("empty --eval corpus", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --eval EMPTY",
     "--eval"),
    ("binary --eval corpus", None, "original", "compress MODEL --ratio 0.3 --calib CORPUS --out OUT --eval BINARY",
     "binary file"),
    ("Latin-1 --calib corpus", None, "original", "compress MODEL --ratio 0.3 --calib LATIN1 --out OUT",
     "--calib"),
    ("--calib /dev/zero", None, "original", "compress MODEL --ratio 0.3 --calib /dev/zero --out OUT",
     "neither a regular file nor a directory"),
    ("empty --train-corpus", None, "original", "linearize MODEL --train-corpus EMPTY --out OUT", "--train-corpus"),
    # models and settings refused in one line
    ("--ratio beyond a rank-1 factorization", None, "original",
     "compress MODEL --ratio 0.9999 --allocation uniform --calib CORPUS --calib-samples 4 --seq-len 32 --out OUT "
     "--no-eval", "--ratio"),
    ("tokenizer larger than the embedding", _smaller_vocabulary, "original", "eval MODEL --ppl CORPUS --seq-len 32",
     "its tokenizer has"),
    ("no tokenizer files", _no_tokenizer, "original", "eval MODEL --ppl CORPUS --seq-len 32", "no tokenizer files"),
    ("pickle weights only", _pickle_only, "original", "eval MODEL --ppl CORPUS --seq-len 32", "pickle weights only"),
    ("--seq-len beyond max_position_embeddings (eval)", None, "original", "eval MODEL --ppl CORPUS --seq-len 300",
     "max_position_embeddings (256)"),
    ("--seq-len beyond max_position_embeddings (compress)", None, "original",
     "compress MODEL --ratio 0.3 --calib CORPUS --seq-len 300 --out OUT --no-eval", "--seq-len 300"),
    ("--seq-len beyond max_position_embeddings (linearize)", None, "original",
     "linearize MODEL --train-corpus CORPUS --seq-len 300 --out OUT --no-eval", "--seq-len 300"),
    ("mla of a compressed model", None, "compressed",
     "mla MODEL --calib CORPUS --calib-samples 4 --seq-len 32 --out OUT --no-eval", "compressed before"),
    ("mla of a family it cannot express", None, "original-qwen3",
     "mla MODEL --calib CORPUS --calib-samples 4 --seq-len 32 --out OUT --no-eval", "q/k norms"),
    ("mla --kv-ratio out of range", None, "original", "mla MODEL --kv-ratio 1.5 --calib CORPUS --out OUT",
     "--kv-ratio"),
    ("teacher with another vocabulary", None, "compressed",
     "heal MODEL --teacher OTHER_VOCAB --train-corpus CORPUS --out OUT --no-eval", "vocabulary of 40 tokens"),
    ("teacher of another architecture", None, "compressed",
     "heal MODEL --teacher OTHER_ARCH --train-corpus CORPUS --out OUT --no-eval", "is a qwen2 model"),
]


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name, damage, which, template, culprit", CASES, ids=[c[0] for c in CASES])
def test_failure_is_one_clear_line_and_loses_nothing(base, tmp_path, capsys, monkeypatch, name, damage, which,
                                                     template, culprit):
    root, model_dir, corpus, compressed = base
    source = {"compressed": compressed, "original-qwen3": root / "qwen3"}.get(which, model_dir)
    model = _copy(source, tmp_path / "model")
    if damage is not None:
        damage(model)
    (tmp_path / "FILE").write_text("a file where a directory is expected")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(bytes(range(256)))
    (tmp_path / "subdir").mkdir()
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "binary.txt").write_bytes(b"text\0\x01\x02" * 50)
    (tmp_path / "latin1.txt").write_bytes("Élisabeth à Pemberley, café\n".encode("latin-1") * 50)
    monkeypatch.chdir(tmp_path)
    before = _digest(tmp_path)
    words = {"MODEL": str(model), "CORPUS": str(corpus), "OUT": str(tmp_path / "out"), "HERE": str(tmp_path),
             "PHOTOS": str(tmp_path / "photos"), "SUBDIR": str(tmp_path / "subdir"), "FILE": str(tmp_path / "FILE"),
             "EMPTY": str(tmp_path / "empty.txt"), "BINARY": str(tmp_path / "binary.txt"),
             "LATIN1": str(tmp_path / "latin1.txt"), "OTHER_ARCH": str(root / "other-architecture"),
             "OTHER_VOCAB": str(root / "other-vocabulary")}
    argv = [words.get(w, w.replace("MODEL/", f"{model}/")) for w in template.split()] + ["--quiet"]
    assert main(argv) == 2, name
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("retrofitter ")]
    assert len(lines) == 1 and ": error: " in lines[0], err
    assert culprit in lines[0], lines[0]
    assert "Traceback" not in err
    assert _digest(tmp_path) == before  # no file changed, none added (no output, no .partial, no lock)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(
        ["model", "photos", "subdir"])  # no directory added either (newdir/, .out.transfer, ...)


@pytest.mark.parametrize("argv", [["compress", "MODEL"], ["compress", "MODEL", "--ratio", "x", "--out", "o"],
                                  ["no-such-command"], ["eval"]])
def test_argument_errors_are_one_line_pointing_to_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0] and err[0].endswith("--help)"), err


def test_debug_shows_the_traceback(base, tmp_path, capsys):
    root, model_dir, corpus, _ = base
    assert main(["--debug", "eval", str(tmp_path / "nope" / "x" / "y"), "--ppl", str(corpus)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_load_raises_one_documented_exception(base, tmp_path):
    import retrofitter
    from retrofitter.errors import ModelLoadError

    _, _, _, compressed = base
    model = _copy(compressed, tmp_path / "model")
    _truncate(model)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        retrofitter.load(model)


def _compress_argv(model_dir, corpus, out) -> list[str]:
    return ["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "4",
            "--seq-len", "32", "--out", str(out), "--no-eval", "--quiet"]


def test_two_runs_on_one_output_one_wins_the_other_fails_at_once(base, tmp_path):
    root, model_dir, corpus, compressed = base
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # one thread, as `base` ran: the same kernels on the same machine, so bitwise
    # The first run is made slow (its layer fit waits on a file) so that it holds the lock.
    gate = tmp_path / "gate"
    code = ("import sys, time, pathlib; import retrofitter.pipelines.local_svd as m; fit = m.LocalSVDStrategy.fit_layer\n"
            "def slow(self, ctx):\n"
            f"    while not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)\n"
            "    return fit(self, ctx)\n"
            "m.LocalSVDStrategy.fit_layer = slow\n"
            "from retrofitter.cli import main; sys.exit(main(sys.argv[1:]))")
    first = subprocess.Popen([sys.executable, "-c", code, *_compress_argv(model_dir, corpus, out)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".out.lock"
    deadline = time.time() + 120
    while not (lock.exists() and lock.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-m", "retrofitter", *_compress_argv(model_dir, corpus, out)], env=env,
                            capture_output=True, text=True, timeout=120)
    gate.write_text("go")
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert second.returncode == 2
    assert f"another retrofitter run (pid {first.pid}) is writing {out}" in second.stderr
    assert "Traceback" not in second.stderr
    solo = load_file(str(compressed / "model.safetensors"))
    raced = load_file(str(out / "model.safetensors"))
    assert sorted(solo) == sorted(raced) and all(torch.equal(solo[k], raced[k]) for k in solo)
    assert not lock.exists()


def test_disk_full_at_save_keeps_the_partial_run_and_a_rerun_resumes(base, tmp_path, monkeypatch, capsys):
    import errno

    import transformers

    import retrofitter.pipelines.local_svd as local_svd

    root, model_dir, corpus, compressed = base
    out = tmp_path / "out"
    save = transformers.PreTrainedModel.save_pretrained

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    assert main(_compress_argv(model_dir, corpus, out)) == 2
    assert "No space left on device" in capsys.readouterr().err
    partial = tmp_path / ".out.partial"
    assert (partial / "progress.json").exists() and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)
    fits = []
    fit = local_svd.LocalSVDStrategy.fit_layer
    monkeypatch.setattr(local_svd.LocalSVDStrategy, "fit_layer", lambda self, ctx: fits.append(1) or fit(self, ctx))
    assert main(_compress_argv(model_dir, corpus, out)) == 0
    assert fits == []  # every layer came from the partial run
    assert not partial.exists()
    solo, resumed = load_file(str(compressed / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(solo[k], resumed[k]) for k in solo)  # one thread both times, same machine: bitwise


def test_output_directories_get_normal_permissions(base, tmp_path):
    _, model_dir, corpus, _ = base
    out = tmp_path / "out"
    assert main(_compress_argv(model_dir, corpus, out)) == 0
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask


def test_degenerate_calibration_is_warned_and_recorded(base, tmp_path):
    _, model_dir, _, _ = base
    corpus = tmp_path / "aaaa.txt"
    corpus.write_text("a" * 4000)
    assert main([*_compress_argv(model_dir, corpus, tmp_path / "out"), "--json", str(tmp_path / "r.json")]) == 0
    warnings = json.loads((tmp_path / "r.json").read_text())["calibration"]["warnings"]
    assert any("highly repetitive" in w for w in warnings)


def test_quiet_prints_no_progress_bar_of_ours_or_of_the_libraries(base, tmp_path, capsys):
    _, model_dir, corpus, _ = base
    capsys.readouterr()
    assert main(_compress_argv(model_dir, corpus, tmp_path / "out")) == 0  # saving: transformers' shard bar
    assert main(["eval", str(tmp_path / "out"), "--ppl", str(corpus), "--seq-len", "32", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "it/s" not in err and "%|" not in err, err
    assert main(["eval", str(tmp_path / "out"), "--ppl", str(corpus), "--seq-len", "32"]) == 0
    assert "%|" in capsys.readouterr().err  # without --quiet the bars are there (the check above can fail)


def test_report_over_a_results_json_with_a_wrong_typed_field(base, tmp_path, capsys):
    _, model_dir, corpus, _ = base
    good = tmp_path / "good.json"
    assert main(["eval", str(model_dir), "--ppl", str(corpus), "--seq-len", "32", "--json", str(good), "--quiet"]) == 0
    record = json.loads(good.read_text())
    record["ppl"] = "not a number"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bad.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json: a field of the wrong type" in err[0] and "internal" not in err[0], err
    assert not (tmp_path / "rep").exists()  # no empty output folder
    (tmp_path / "runs" / "good.json").write_text(good.read_text())  # one bad file costs its rows, not the report
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "skipped" in report and "bad.json: a field of the wrong type" in report
