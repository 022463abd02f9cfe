"""CLI smoke tests on a tiny local model directory and a local text corpus (no download)."""

import json

import pytest
import torch

import retrofitter
from retrofitter.cli import main
from retrofitter.modules.latent_linear import LatentLinear
from tiny_models import SAMPLE_TEXT


def test_eval_writes_contract_json(workspace, capsys):
    tmp, model_dir, corpus = workspace
    assert main(["eval", str(model_dir), "--ppl", str(corpus), "--seq-len", "32", "--json", str(tmp / "e.json"),
                 "--quiet"]) == 0
    data = json.loads((tmp / "e.json").read_text())
    for key in ("model", "method", "ratio", "ppl", "params", "kv_bytes_per_token", "settings", "timings_s", "peak_rss_mb"):
        assert key in data
    assert set(data["params"]) == {"total", "linear", "embedding"}
    assert data["ppl"][str(corpus)] > 1
    assert "ppl" in capsys.readouterr().out


def test_eval_passkey_records_accuracy_per_context_and_refuses_too_long_prompts(workspace, capsys):
    tmp, model_dir, corpus = workspace
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 600}))
    base = ["eval", str(model_dir), "--ppl", str(corpus), "--seq-len", "32", "--quiet"]
    assert main(base + ["--passkey", "350,500", "--passkey-trials", "1", "--json", str(tmp / "p.json")]) == 0
    passkey = json.loads((tmp / "p.json").read_text())["passkey"]
    assert set(passkey["by_context"]) == {"350", "500"} and len(passkey["trials"]) == 2 * 3
    lengths = {t["context"]: t["prompt_tokens"] for t in passkey["trials"]}
    assert lengths[350] < lengths[500] <= 500  # the filler repeats up to the length
    assert "passkey retrieval:" in capsys.readouterr().out
    assert main(base + ["--passkey", "601"]) == 2
    assert "exceeds the model's max_position_embeddings (600)" in capsys.readouterr().err


def test_eval_quantize_reports_int8_bytes(workspace, capsys):
    from retrofitter.api import load_model
    from retrofitter.eval.accounting import stored_bytes

    tmp, model_dir, corpus = workspace
    base = ["eval", str(model_dir), "--ppl", str(corpus), "--seq-len", "32", "--quiet", "--json"]
    assert main(base + [str(tmp / "float.json")]) == 0
    assert main(base + [str(tmp / "int8.json"), "--quantize", "int8-weight"]) == 0
    plain, data = (json.loads((tmp / f"{n}.json").read_text()) for n in ("float", "int8"))
    assert data["settings"]["quantize"] == "int8-weight" and plain["settings"]["quantize"] is None
    assert "original+int8-weight" in capsys.readouterr().out
    quantized, _ = load_model(str(model_dir), quantize="int8-weight")
    assert data["bytes"]["stored"] == stored_bytes(quantized) < plain["bytes"]["stored"]
    assert data["params"] == plain["params"]
    assert data["ppl"][str(corpus)] == pytest.approx(plain["ppl"][str(corpus)], rel=2e-2)
    with pytest.raises(SystemExit):  # argparse: the choices are listed
        main(["eval", str(model_dir), "--quantize", "int4"])


def test_compress_save_load_eval_round_trip(workspace):
    tmp, model_dir, corpus = workspace
    out = tmp / "compressed"
    args = ["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "4",
            "--seq-len", "32", "--eval", str(corpus), "--out", str(out), "--json", str(tmp / "c.json"), "--quiet",
            "--measure-cost"]
    assert main(args) == 0
    data = json.loads((tmp / "c.json").read_text())
    assert data["method"] == "asvd-rootcov" and data["ratio"] == 0.3
    assert data["reduction"]["linear"] >= 0.3
    assert data["cost"]["compress_over_calibration_forward"] > 0
    assert data["cost"]["statistics_spill_bytes"] > 0  # the default reads the plan's statistics from disk
    cost = data["cost"]
    # the floor (RSS before the model is loaded) is positive; in a long-lived process such as this test
    # session the heap freed during compression can make the difference small or negative
    assert isinstance(cost["peak_rss_above_floor_over_fp32_model"], float)
    assert cost["peak_rss_above_floor_over_fp32_model"] < cost["peak_rss_over_fp32_model"]
    floor = cost["rss_mb"]["before_load"]
    assert floor > 0  # the process before the model was loaded
    assert abs(cost["peak_rss_above_floor_over_fp32_model"]
               - (data["compress_peak_rss_mb"] - floor) / cost["fp32_model_mb"]) < 1e-9
    assert (out / "retrofitter.json").exists() and (out / "model.safetensors").exists()
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))

    model, tokenizer = retrofitter.load(out)
    assert any(isinstance(m, LatentLinear) for m in model.modules())
    # the saved directory evaluates to the same perplexity as the in-process result
    assert main(["eval", str(out), "--ppl", str(corpus), "--seq-len", "32", "--json", str(tmp / "e.json"), "--quiet"]) == 0
    again = json.loads((tmp / "e.json").read_text())
    assert again["ppl"][str(corpus)] == pytest.approx(data["ppl"][str(corpus)], rel=1e-5)
    assert again["params"] == data["params"]
    assert again["method"] == "asvd-rootcov"

    # an existing output is refused without --overwrite, and left untouched
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 2
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_compressed_directory_is_smaller_on_disk(workspace):
    tmp, model_dir, corpus = workspace
    out = tmp / "small"
    assert main(["compress", str(model_dir), "--ratio", "0.5", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--out", str(out), "--no-eval", "--quiet"]) == 0
    assert (out / "model.safetensors").stat().st_size < (model_dir / "model.safetensors").stat().st_size


def test_saved_model_generates(workspace):
    tmp, model_dir, corpus = workspace
    out = tmp / "gen"
    assert main(["compress", str(model_dir), "--ratio", "0.2", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--out", str(out), "--no-eval", "--quiet"]) == 0
    model, tokenizer = retrofitter.load(out)
    ids = tokenizer("a truth", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5


@pytest.mark.parametrize("argv, message", [
    (["compress", "MODEL", "--ratio", "1.5", "--out", "X"], "ratio must lie in (0, 1)"),
    (["eval", "/nonexistent/dir/model", "--ppl", "wiki-eval"], "error"),
])
def test_bad_input_gives_one_clear_line(argv, message, workspace, capsys):
    tmp, model_dir, corpus = workspace
    argv = [str(model_dir) if a == "MODEL" else str(tmp / "x") if a == "X" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_too_few_calibration_blocks_is_a_clear_error(workspace, capsys):
    tmp, model_dir, corpus = workspace
    assert main(["compress", str(model_dir), "--ratio", "0.2", "--calib", str(corpus), "--calib-samples", "500",
                 "--seq-len", "32", "--out", str(tmp / "o"), "--no-eval", "--quiet"]) == 2
    assert "--calib-samples asks for 500" in capsys.readouterr().err
    assert not (tmp / "o").exists()


def test_compress_with_global_fisher_allocation_and_latentllm_switches(workspace):
    tmp, model_dir, corpus = workspace
    out = tmp / "global"
    assert main(["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--method", "latentllm", "--allocation", "global", "--allocation-weighting",
                 "fisher", "--allocation-gradient-blocks", "2", "--no-joint-mlp", "--qk-iterations", "2",
                 "--out", str(out), "--no-eval", "--quiet", "--json", str(tmp / "g.json")]) == 0
    data = json.loads((tmp / "g.json").read_text())
    config = data["settings"]["compress_config"]
    assert config["allocation"] == "global" and config["allocation_weighting"] == "fisher"
    assert config["options"]["joint_mlp"] is False and config["options"]["qk_iterations"] == 2
    assert data["reduction"]["linear"] >= 0.29
    ranks = {layer["matrices"][name]["rank"] for layer in data["layers"] for name in layer["matrices"]}
    assert len(ranks) > 2  # globally allocated, not one rank per shape
    model, _ = retrofitter.load(out)
    assert any(isinstance(m, LatentLinear) for m in model.modules())


def test_eval_reports_perplexity_of_an_architecture_without_adapter(tmp_path):
    from tiny_models import build_tiny_tokenizer, build_tiny_without_adapter

    model_dir = tmp_path / "neox"
    build_tiny_without_adapter().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    assert main(["eval", str(model_dir), "--ppl", str(corpus), "--seq-len", "32", "--json", str(tmp_path / "e.json"),
                 "--quiet"]) == 0
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["ppl"][str(corpus)] > 1
    assert data["params"]["total"] == sum(p.numel() for p in build_tiny_without_adapter().parameters())


def test_every_config_field_has_a_flag_with_the_config_default():
    import dataclasses

    from retrofitter.cli import build_parser
    from retrofitter.config import COMPRESS_METHODS, CompressConfig, LinearizeConfig

    parser = build_parser()
    compress = parser.parse_args(["compress", "m", "--ratio", "0.3", "--out", "o"])
    names = {f.name for f in dataclasses.fields(CompressConfig)} - {"options"}  # the method's options: their own
    for spec in COMPRESS_METHODS.values():
        names |= {f.name for f in dataclasses.fields(spec.options)}
    assert names <= set(vars(compress))  # one flag per field
    assert all(vars(compress)[n] is None for n in names - {"ratio"})  # unset flags keep the config's default
    linearize = parser.parse_args(["linearize", "m", "--out", "o", "--no-gradient-checkpointing", "--window", "32",
                                   "--keep-softmax-layers", "0,1"])
    assert (linearize.gradient_checkpointing, linearize.window, linearize.keep_softmax_layers) == (False, 32, (0, 1))
    assert {f.name for f in dataclasses.fields(LinearizeConfig)} - set(vars(linearize)) == {
        "grad_clip", "lora_dropout", "mix_init"}


def test_mla_preset_sets_the_recipe_and_explicit_flags_override_it(workspace, monkeypatch):
    import retrofitter.jobs as jobs
    from retrofitter.pipelines.mla import MLA_PRESETS

    tmp, model_dir, corpus = workspace
    seen = []
    monkeypatch.setattr(jobs, "mla_job", lambda *args, **kwargs: seen.append((args, kwargs)) or {})
    monkeypatch.setattr("retrofitter.cli.show_results", lambda results, args: 0)
    base = ["mla", str(model_dir), "--out", str(tmp / "m"), "--calib", str(corpus), "--quiet"]
    assert main(base + ["--preset", "quality"]) == 0
    assert main(base + ["--preset", "quality", "--transfer-epochs", "1", "--calib-samples", "2",
                        "--transfer-context", "0"]) == 0
    assert main(base) == 0
    (preset_args, preset_kwargs), (override_args, override_kwargs), (plain_args, plain_kwargs) = seen
    recipe = MLA_PRESETS["quality"]
    assert preset_kwargs["calib_samples"] == recipe["calib_samples"] == 896
    assert {k: getattr(preset_args[2], k) for k in recipe["config"]} == recipe["config"]
    assert preset_args[2].transfer_batch == 1  # one block per Adam step (docs/results.md 13d)
    assert preset_args[2].transfer_context == 2048  # skipped positions: distances to 2048 (docs/results.md 13d)
    assert override_kwargs["calib_samples"] == 2 and override_args[2].transfer_epochs == 1
    assert override_args[2].transfer_context == 0
    assert override_args[2].transfer_target == recipe["config"]["transfer_target"]
    assert plain_kwargs["calib_samples"] == 32 and plain_args[2].transfer_epochs == 0
    assert plain_kwargs["seq_len"] == 512 and plain_args[3].seq_len == 512


def test_mla_long_context_preset_calibrates_on_long_blocks_and_evaluates_at_512(workspace, monkeypatch):
    import retrofitter.jobs as jobs
    from retrofitter.pipelines.mla import MLA_PRESETS

    tmp, model_dir, corpus = workspace
    seen = []
    monkeypatch.setattr(jobs, "mla_job", lambda *args, **kwargs: seen.append((args, kwargs)) or {})
    monkeypatch.setattr("retrofitter.cli.show_results", lambda results, args: 0)
    base = ["mla", str(model_dir), "--out", str(tmp / "m"), "--calib", str(corpus), "--quiet", "--preset", "long-context"]
    assert main(base) == 0
    assert main(base + ["--seq-len", "1024"]) == 0
    assert main(base + ["--eval-seq-len", "2048"]) == 0
    (preset_args, preset_kwargs), (explicit_args, explicit_kwargs), (window_args, _) = seen
    recipe = MLA_PRESETS["long-context"]
    assert preset_kwargs["seq_len"] == recipe["seq_len"] == 2048 and preset_kwargs["calib_samples"] == 64
    assert preset_args[2].transfer_batch == 1 and preset_args[2].transfer_epochs == 4
    assert preset_args[3].seq_len == 512  # perplexity stays at the default window
    assert explicit_kwargs["seq_len"] == 1024 and explicit_args[3].seq_len == 1024
    assert window_args[3].seq_len == 2048
