"""LatentLLM pipeline end to end on tiny models (Llama with GQA + RoPE, OPT with biases)."""

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.checkpoint import load_retrofitted, save_retrofitted
from retrofitter.config import CompressConfig
from retrofitter.modules.latent_attention import LatentAttention
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.sequential import summarize

from tiny_models import strong_tiny
from tiny_models import TINY_VOCAB, build_tiny




def calibration(n=8, seq=32, seed=1):
    return torch.randint(3, TINY_VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def loss(model, tokens, reference):
    with torch.no_grad():
        return float((model(tokens).logits - reference).pow(2).mean())


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_end_to_end_replaces_everything_and_meets_ratio(family):
    tokens = calibration()
    model, report = compress_model(strong_tiny(family), CompressConfig(method="latentllm", ratio=0.3, batch_size=4),
                                   tokens, progress=False)
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        assert isinstance(adapter.attention(layer), LatentAttention)
        for name in adapter.linear_names:
            assert isinstance(adapter.get_linear(layer, name), LatentLinear)
    assert 0.3 - 1e-9 <= report["targets_reduction"] < 0.45
    expected_keys = set(summarize(CompressConfig(), [], {}).keys()) | {"allocation", "ranks", "cache_numbers_per_token"}
    assert expected_keys <= set(report)
    methods = {e["method"] for r in report["layers"] for e in r["matrices"].values()}
    assert {"joint_qk", "joint_mlp_streaming"} <= methods
    for layer_report in report["layers"]:
        history = layer_report["qk_objective"]
        assert all(b >= a * (1 - 1e-9) for a, b in zip(history, history[1:]))  # never decreases
        assert 0 <= layer_report["qk_score_error"] < 1
    assert torch.isfinite(model(tokens).logits).all()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_joint_mlp_streaming_beats_local_down(family):
    tokens = calibration()
    reference = strong_tiny(family)(tokens).logits
    errors = {}
    for joint in (False, True):
        config = CompressConfig(method="latentllm", ratio=0.5, joint_qk=False, joint_mlp=joint, batch_size=4,
                                targets=adapter_for(strong_tiny(family)).linear_groups[-2]
                                + adapter_for(strong_tiny(family)).linear_groups[-1])
        model, _ = compress_model(strong_tiny(family), config, tokens, progress=False)
        errors[joint] = loss(model, tokens, reference)
    assert errors[True] < errors[False]


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_select_down_fit_takes_the_held_out_winner_refitted_on_all_batches(family):
    tokens = calibration()
    groups = adapter_for(strong_tiny(family)).linear_groups
    base = dict(method="latentllm", ratio=0.5, joint_qk=False, batch_size=4, targets=groups[-2] + groups[-1])
    down = groups[-1][0]
    models = {}
    for name, part in {"select": dict(down_fit="select"), "joint": dict(down_fit="anchored"),
                       "local": dict(joint_mlp=False)}.items():
        models[name] = compress_model(strong_tiny(family), CompressConfig(**base, **part), tokens, progress=False)
    (selected, report), adapter = models["select"], adapter_for(models["select"][0])
    kinds = set()
    for index, layer_report in enumerate(report["layers"]):
        entry = layer_report["matrices"][down]
        held_out = entry["held_out_error"]
        kind = min(held_out, key=held_out.get)
        kinds.add(kind)
        assert entry["method"] == {"joint": "joint_mlp_streaming", "local": "local_by_held_out_error"}[kind]
        if index:  # later layers see inputs made by the earlier choices: only layer 0 has a same-input reference
            continue
        chosen = adapter.get_linear(adapter.decoder_layers(selected)[index], down)
        other = models[kind][0]
        reference = adapter.get_linear(adapter.decoder_layers(other)[index], down)
        assert torch.allclose(chosen.dense_weight(), reference.dense_weight(), atol=1e-5)
    assert kinds


@pytest.mark.parametrize("part", [dict(joint_vo=True), dict(mlp_algorithm="auxiliary", mlp_aux_tokens=128),
                                  dict(statistics="teacher"), dict(latent_attention=False)])
def test_switches_run_and_stay_close(part):
    tokens = calibration()
    reference = strong_tiny("llama")(tokens).logits
    model, report = compress_model(strong_tiny("llama"), CompressConfig(method="latentllm", ratio=0.3, batch_size=4,
                                                                        **part), tokens, progress=False)
    assert loss(model, tokens, reference) < reference.pow(2).mean()
    attention_type = type(adapter_for(model).attention(adapter_for(model).decoder_layers(model)[0]))
    assert (attention_type is LatentAttention) == part.get("latent_attention", True)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_save_load_round_trip_identical_logits(family, tmp_path):
    tokens = calibration(4, 16)
    model, report = compress_model(strong_tiny(family), CompressConfig(method="latentllm", ratio=0.3, batch_size=4),
                                   tokens, progress=False)
    expected = model(tokens).logits
    save_retrofitted(model, tmp_path / "c", {"method": "latentllm", "report_ratio": report["ratio"]})
    loaded = load_retrofitted(tmp_path / "c")
    assert torch.equal(loaded(tokens).logits, expected)


def test_checkpoint_resume_gives_same_model(tmp_path):
    tokens = calibration(4, 16)
    config = CompressConfig(method="latentllm", ratio=0.3, batch_size=4, latent_attention=False)
    straight, _ = compress_model(strong_tiny("llama"), config, tokens, progress=False)
    # simulate an interrupted run: finish it with a checkpoint dir, then a second run restores every layer
    checkpoint = tmp_path / "ckpt"
    model, _ = compress_model(strong_tiny("llama"), config, tokens, progress=False, checkpoint_dir=checkpoint)
    torch.testing.assert_close(model(tokens).logits, straight(tokens).logits)
