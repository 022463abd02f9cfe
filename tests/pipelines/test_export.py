"""Export of an MLA model as a plain transformers DeepSeek-V3 directory (no llama.cpp here: tests/engines).

Claims: the written directory loads with ``AutoModelForCausalLM`` alone and reproduces the MLA model's logits
(float64 to rounding; float32 within the export's own 1e-4 check) and greedy tokens, for untied and tied
heads and an ε other than DeepSeek's; what the format cannot hold is refused in one line before any file is
written; outputs are never overwritten silently."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from retrofitter.adapters.deepseek_export import ExportError, deepseek_v3_checkpoint
from retrofitter.checkpoint import OutputExistsError
from retrofitter.cli import main
from retrofitter.pipelines.export import EXPORT_JSON, export_hf
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
import retrofitter
from greedy import assert_same_greedy, generated
from tiny_models import TINY_VOCAB, _common, build_tiny_tokenizer, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))
IDS = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


def _mla(model, selection="progression", kv_ratio=0.5, fold=True):
    convert_to_mla(model, MLAConfig(kv_ratio=kv_ratio, rope_fraction=0.5, rope_selection=selection, damping=1e-9,
                                    fold_up_projections=fold), CALIBRATION, progress=False)
    return model


def _tied_llama(dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_common(tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and ".layers." in name:
                param.mul_(8)
    return model


def _deepseek(model, dtype):
    """The exported checkpoint built in memory by plain transformers (float64 allowed here, unlike on disk)."""
    config, state = deepseek_v3_checkpoint(model, dtype=dtype)
    config["dtype"] = str(dtype).removeprefix("torch.")
    exported = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).to(dtype).eval()
    missing, unexpected = exported.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    exported.tie_weights()
    return exported


@pytest.mark.parametrize("build", [lambda d: strong_tiny("llama", dtype=d), lambda d: strong_tiny("mistral", dtype=d),
                                   _tied_llama], ids=["llama", "mistral", "llama-tied-eps1e-5"])
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "up-projections-kept"])
def test_deepseek_checkpoint_reproduces_the_mla_model_in_float64(build, fold):
    model = _mla(build(torch.float64), fold=fold)
    assert (model.model.layers[0].self_attn.k_up is None) is fold
    with torch.no_grad():
        reference = model(IDS).logits
        logits = _deepseek(model, torch.float64)(IDS).logits
    # every step of the rewrite is exact in real arithmetic except the latent norm, whose relative effect is
    # δ/2 <= 2^-31 (deepseek_export.py); HF builds its rope tables in float32 (rel. 6e-8 per angle), which on
    # logits of magnitude ~1 through two layers gives a few 1e-7
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-6 * float(reference.abs().max()))


def test_export_hf_loads_with_plain_transformers_and_generates_the_same(tmp_path):
    model = _mla(strong_tiny("llama"))
    record = export_hf(model, tmp_path / "ds", build_tiny_tokenizer(), metadata={"source_model": "tiny"})
    assert record["parity"]["checked"] and record["parity"]["max_rel_error"] <= 1e-4
    assert json.loads((tmp_path / "ds" / EXPORT_JSON).read_text())["kv_lora_rank"] == record["kv_lora_rank"]
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "ds")("ab").input_ids
    prompt = IDS[:1, :8]
    with torch.no_grad():
        kwargs = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ours = model.generate(prompt, **kwargs)
        theirs = exported.generate(prompt, **kwargs)
    # two float32 computations of the same function (other matrix shapes): logits of magnitude < 10 agree to a
    # few 1e-6, so equal greedy tokens follow from the margins (tests/greedy.py)
    assert_same_greedy(*generated(theirs, 8), *generated(ours, 8), rtol=2e-5, atol=2e-5)


def test_what_deepseek_cannot_hold_is_refused_before_any_file(tmp_path):
    with pytest.raises(ExportError, match="--rope-selection progression"):
        export_hf(_mla(strong_tiny("llama"), selection="score"), tmp_path / "a")
    with pytest.raises(ExportError, match="supports LlamaForCausalLM, MistralForCausalLM .* got Qwen2ForCausalLM"):
        export_hf(_mla(strong_tiny("qwen2")), tmp_path / "b")
    with pytest.raises(ExportError, match="no MLA layers"):
        export_hf(strong_tiny("llama"), tmp_path / "c")
    assert not any(tmp_path.iterdir())


def test_an_existing_output_is_never_replaced_silently(tmp_path):
    model = _mla(strong_tiny("llama"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_hf(model, tmp_path / "mine")
    with pytest.raises(OutputExistsError, match="not a previous hf export"):
        export_hf(model, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    export_hf(model, tmp_path / "ds", verify=False)
    export_hf(model, tmp_path / "ds", overwrite=True)  # a previous export is replaced once the new one is complete
    assert json.loads((tmp_path / "ds" / EXPORT_JSON).read_text())["parity"]["checked"]


def test_cli_export_from_a_saved_mla_directory(tmp_path, capsys):
    model = _mla(strong_tiny("llama"))
    retrofitter.save(model, tmp_path / "mla", tokenizer=build_tiny_tokenizer(), metadata={"method": "mla",
                                                                                          "source_model": "tiny"})
    assert main(["export", str(tmp_path / "mla"), "--format", "hf", "--out", str(tmp_path / "ds"), "--quiet"]) == 0
    assert "DeepseekV3ForCausalLM" in capsys.readouterr().out
    record = json.loads((tmp_path / "ds" / EXPORT_JSON).read_text())
    assert record["method"] == "mla" and record["original_model"] == "tiny"
    assert main(["export", str(tmp_path / "mla"), "--format", "hf", "--out", str(tmp_path / "mla")]) == 2
    assert "--out" in capsys.readouterr().err


def test_gguf_refusals_come_before_llama_cpp_is_needed(tmp_path):
    from retrofitter.config import CompressConfig
    from retrofitter.pipelines.export import export_gguf

    tokenizer = build_tiny_tokenizer()
    with pytest.raises(ValueError, match="float16 cannot hold"):
        export_gguf(_mla(strong_tiny("llama")), tmp_path / "m.gguf", tokenizer, outtype="f16")
    compressed = retrofitter.compress(strong_tiny("llama"), CompressConfig(ratio=0.3, batch_size=4), CALIBRATION,
                                      progress=False)
    compressed = compressed[0] if isinstance(compressed, tuple) else compressed
    with pytest.raises(ExportError, match="no engine format holds"):
        export_gguf(compressed, tmp_path / "m.gguf", tokenizer)
    with pytest.raises(ExportError, match="--rope-selection progression"):
        export_gguf(_mla(strong_tiny("llama"), selection="score"), tmp_path / "m.gguf", tokenizer)
    assert not any(tmp_path.iterdir())


def test_every_frequency_kept_exports_with_the_original_rope_base():
    """SmolLM2's rotary table (head_dim 64, base 100000, float32) with all 32 frequencies in the shared key
    (progression step 1, as at KV 0.5×): base' is the original base. Taken from θ_1 alone it came out
    100000.124 (θ_1's float32 rounding × 32), off the table by 1.3e-6 and refused; the fit over every slot
    is within float32 rounding."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_common(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                rope_theta=100000.0))
    model = _mla(transformers.AutoModelForCausalLM.from_config(config).eval(), kv_ratio=1.0)
    assert all(layer.self_attn.rope_dim == 64 for layer in model.model.layers)
    ds_config, _ = deepseek_v3_checkpoint(model, dtype=torch.float32)
    assert ds_config["rope_parameters"]["rope_theta"] == pytest.approx(100000.0, rel=1e-6)
