"""LatentLLM pipeline end to end on tiny models (Llama with GQA + RoPE, OPT with biases)."""

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.checkpoint import load_retrofitted, save_retrofitted
from retrofitter.config import CompressConfig
from retrofitter.linalg.joint_mlp import fit_down_to_compressed
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
        config = CompressConfig.from_flat(dict(method="latentllm", ratio=0.5, joint_qk=False, joint_mlp=joint, batch_size=4,
                                targets=adapter_for(strong_tiny(family)).linear_groups[-2]
                                + adapter_for(strong_tiny(family)).linear_groups[-1]))
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
        models[name] = compress_model(strong_tiny(family), CompressConfig.from_flat(dict(**base, **part)), tokens, progress=False)
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
    model, report = compress_model(strong_tiny("llama"), CompressConfig.from_flat(dict(method="latentllm", ratio=0.3, batch_size=4,
                                                                        **part)), tokens, progress=False)
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
    assert torch.equal(loaded(tokens).logits, expected)  # same float32 weights, modules and shapes: bitwise


def test_checkpoint_resume_gives_same_model(tmp_path):
    tokens = calibration(4, 16)
    config = CompressConfig.from_flat(dict(method="latentllm", ratio=0.3, batch_size=4, latent_attention=False))
    straight, _ = compress_model(strong_tiny("llama"), config, tokens, progress=False)
    # simulate an interrupted run: finish it with a checkpoint dir, then a second run restores every layer
    checkpoint = tmp_path / "ckpt"
    model, _ = compress_model(strong_tiny("llama"), config, tokens, progress=False, checkpoint_dir=checkpoint)
    torch.testing.assert_close(model(tokens).logits, straight(tokens).logits)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_teacher_target_joint_fits_equal_the_plain_ones_where_both_streams_agree(family):
    """Layer 0's attention input is the same in both streams (C_tc = C_cc): joint QK and v equal the plain
    fit's; later layers are corrected towards the original's outputs."""
    tokens = calibration()
    config = dict(method="latentllm", ratio=0.3, batch_size=4, allocation="uniform", latent_attention=False)
    plain, _ = compress_model(strong_tiny(family), CompressConfig.from_flat(dict(**config)), tokens, progress=False)
    target, report = compress_model(strong_tiny(family), CompressConfig.from_flat(dict(statistics="teacher_target", **config)),
                                    tokens, progress=False)
    adapter = adapter_for(plain)
    for name in ("q", "k", "v"):
        expected = adapter.get_linear(adapter.decoder_layers(plain)[0], name)
        actual = adapter.get_linear(adapter.decoder_layers(target)[0], name)
        torch.testing.assert_close(actual.dense_weight(), expected.dense_weight(), rtol=1e-5, atol=1e-5)
        if expected.bias is not None:
            torch.testing.assert_close(actual.bias, expected.bias, rtol=1e-5, atol=1e-5)
    later = [(adapter.get_linear(adapter.decoder_layers(m)[1], "q").dense_weight() for m in (plain, target))]
    assert not torch.allclose(*later[0], atol=1e-4)
    methods = {e["method"] for r in report["layers"] for e in r["matrices"].values()}
    assert methods == {"joint_qk", "teacher_target", "joint_mlp_streaming"}


def test_teacher_target_down_fit_is_the_anchored_fit_of_the_teachers_intermediate():
    """Layer 0's down: h = act(W_g x_t) ⊙ W_u x_t from the original's MLP input, ĥ from the compressed model's
    (its layer 0 is final once fitted), collected here by hooks and fitted in float64. Plain factors: the
    junction form reorders the MLP's intermediate units."""
    tokens = calibration()
    config = CompressConfig.from_flat(dict(method="latentllm", ratio=0.3, batch_size=4, statistics="teacher_target",
                            latent_attention=False, junction=False))
    original = strong_tiny("llama")
    model, report = compress_model(strong_tiny("llama"), config, tokens, progress=False)
    adapter = adapter_for(model)

    def mlp_input(m):
        seen = []
        layer = adapter.decoder_layers(m)[0]
        handle = adapter.get_linear(layer, "gate").register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        with torch.no_grad():
            m(tokens)
        handle.remove()
        return seen[0].reshape(-1, seen[0].shape[-1]).to(torch.float64), layer

    (x_t, teacher_layer), (x_c, layer) = mlp_input(original), mlp_input(model)
    act = adapter.mlp_activation(teacher_layer)
    g_t, u_t, d_t = (adapter.get_linear(teacher_layer, n).weight.double() for n in ("gate", "up", "down"))
    g_c, u_c = (adapter.get_linear(layer, n).dense_weight().double() for n in ("gate", "up"))
    h = act(x_t @ g_t.T) * (x_t @ u_t.T)
    h_hat = act(x_c @ g_c.T) * (x_c @ u_c.T)
    n = h.shape[0]
    rank = report["layers"][0]["matrices"]["down"]["rank"]
    B, A = fit_down_to_compressed(d_t, h.T @ h_hat / n, h_hat.T @ h_hat / n, rank, config.damping)
    down = adapter.get_linear(layer, "down")
    torch.testing.assert_close(down.dense_weight().double(), B @ A, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_teacher_target_brings_latentllm_closer_to_the_original(family):
    tokens = calibration()
    reference = strong_tiny(family)(tokens).logits
    errors = {}
    for statistics in ("compressed", "teacher_target"):
        config = CompressConfig(method="latentllm", ratio=0.4, batch_size=4, statistics=statistics)
        model, _ = compress_model(strong_tiny(family), config, tokens, progress=False)
        errors[statistics] = loss(model, tokens, reference)
    assert errors["teacher_target"] < errors["compressed"]


def test_teacher_target_refuses_the_auxiliary_mlp():
    with pytest.raises(ValueError, match="--mlp-algorithm streaming"):
        CompressConfig.from_flat(dict(method="latentllm", statistics="teacher_target", mlp_algorithm="auxiliary"))
