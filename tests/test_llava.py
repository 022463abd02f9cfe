"""LLaVA / LLaVA-NeXT: only the language model is compressed; the model keeps seeing images.

Per row (tests/tiny_models.py: CLIP tower + Llama text, LLaVA-NeXT tiles + Mistral text): compress on text
token blocks (``asvd-rootcov``, ``latentllm`` with its latent k/v cache), the vision tower, projector,
embeddings and head untouched, save (in-memory key layout, head included) → load → identical logits on
image+text inputs, and ``generate`` with ``pixel_values`` (each step equal to the full forward).
``load_model`` reads both a saved retrofitter directory and a plain HF LLaVA directory, whose
``save_pretrained`` writes the legacy layout (``language_model.model.layers.*``, ``language_model.lm_head``).
The text-only paths (full-rank conversion, capture, text generation) run in tests/test_families.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from retrofitter.adapters import UnsupportedArchitectureError, adapter_for
from retrofitter.api import load_model
from retrofitter.checkpoint import load_retrofitted, save_retrofitted
from retrofitter.config import CompressConfig
from retrofitter.modules.latent_attention import LatentAttention
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model

from tiny_models import IMAGE_SIZE, IMAGE_TOKEN, TINY_VOCAB, build_tiny, build_tiny_tokenizer, strong_tiny

LANGUAGE = ("model.language_model.", "lm_head.")


def text_blocks(batch=8, length=32, seed=1):
    """Calibration: text tokens only (no image placeholder)."""
    return torch.randint(3, IMAGE_TOKEN, (batch, length), generator=torch.Generator().manual_seed(seed))


def image_inputs(model, batch=2, text=6, seed=2):
    """input_ids with one image's placeholders after BOS, and the pixel inputs (+ image_sizes for LLaVA-NeXT)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    if type(model).__name__.startswith("LlavaNext"):  # one 16×32 image: base tile + 2 tiles of 16×16
        inputs["pixel_values"] = torch.randn(batch, 3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        inputs["image_sizes"] = torch.tensor([[IMAGE_SIZE, 2 * IMAGE_SIZE]] * batch)
        with torch.no_grad():
            features = model.get_image_features(**inputs).pooler_output
        n_image = features[0].shape[0]
    else:
        inputs["pixel_values"] = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        n_image = model.config.image_seq_length
    ids = torch.randint(3, IMAGE_TOKEN, (batch, 1 + n_image + text), generator=generator)
    ids[:, 1:1 + n_image] = IMAGE_TOKEN
    return {"input_ids": ids, **inputs}


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def non_language_state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if not name.startswith(LANGUAGE)}


@pytest.mark.parametrize("method", ("asvd-rootcov", "latentllm"))
@pytest.mark.parametrize("family", ("llava", "llava_next"))
def test_compress_the_language_model_save_load_and_generate_with_images(family, method, tmp_path):
    model = strong_tiny(family)
    vision_before = non_language_state(model)
    head_before = model.lm_head.weight.clone()
    embed_before = model.get_input_embeddings().weight.clone()
    model, report = compress_model(model, CompressConfig(method=method, ratio=0.3, batch_size=4), text_blocks(),
                                   progress=False)

    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    assert layers is model.model.language_model.layers
    for layer in layers:
        assert all(isinstance(adapter.get_linear(layer, name), LatentLinear) for name in adapter.linear_names)
    assert isinstance(adapter.attention(layers[0]), LatentAttention) == (method == "latentllm")
    # the vision tower and the projector: dense, bit for bit; embeddings and head too
    for name, tensor in non_language_state(model).items():
        assert torch.equal(tensor, vision_before[name]), name
    assert not any(isinstance(m, (LatentLinear, LatentAttention)) for m in model.model.vision_tower.modules())
    assert all(type(m) is nn.Linear for m in model.model.multi_modal_projector.modules() if isinstance(m, nn.Linear))
    assert torch.equal(model.lm_head.weight, head_before)
    assert torch.equal(model.get_input_embeddings().weight, embed_before)

    inputs = image_inputs(model)
    expected = logits(model, inputs)
    assert torch.isfinite(expected).all()
    other_images = {**inputs, "pixel_values": inputs["pixel_values"] + 1}
    assert not torch.equal(expected, logits(model, other_images))  # the images reach the language model
    save_retrofitted(model, tmp_path / "m", {"method": method})
    replaced = json.loads((tmp_path / "m" / "retrofitter.json").read_text())["replacements"]
    assert replaced and all(path.startswith("model.language_model.layers.") for path in replaced)
    keys = set(load_file(tmp_path / "m" / "model.safetensors"))
    assert "lm_head.weight" in keys and not any(key.startswith("language_model.") for key in keys)
    loaded = load_retrofitted(tmp_path / "m")
    assert type(loaded) is type(model)
    # same float32 weights (copied into freshly allocated parameters), same modules, same shapes: bitwise
    torch.testing.assert_close(logits(loaded, inputs), expected, rtol=0, atol=0)

    prompt = {key: value[:1] for key, value in inputs.items()}
    length = prompt["input_ids"].shape[1]
    with torch.no_grad():
        out = loaded.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        full = loaded(**{**prompt, "input_ids": out.sequences}, use_cache=False).logits
    assert out.sequences.shape[1] == length + 4
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, length - 1:-1], rtol=1e-5, atol=1e-5)
    if method == "latentllm":
        assert report["cache_numbers_per_token"] > 0


def test_load_model_reads_saved_and_plain_hf_llava_directories(tmp_path):
    tokenizer = build_tiny_tokenizer()
    original = build_tiny("llava")
    inputs = image_inputs(original)
    original.save_pretrained(tmp_path / "hf")  # HF's default: the legacy key layout
    tokenizer.save_pretrained(tmp_path / "hf")
    assert "language_model.lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    model, loaded_tokenizer = load_model(str(tmp_path / "hf"))
    assert type(model).__name__ == "LlavaForConditionalGeneration" and loaded_tokenizer is not None
    # the same float32 weights under their legacy names, the same modules and shapes: bitwise (transformers keeps
    # them file-mapped, other alignment than the original's: see tests/pipelines/test_offload.py)
    torch.testing.assert_close(logits(model, inputs), logits(original, inputs), rtol=0, atol=0)

    model, _ = compress_model(model, CompressConfig(method="asvd-rootcov", ratio=0.3, batch_size=4), text_blocks(),
                              progress=False)
    save_retrofitted(model, tmp_path / "ours", {"method": "asvd-rootcov"}, tokenizer=loaded_tokenizer)
    reloaded, reloaded_tokenizer = load_model(str(tmp_path / "ours"))
    assert reloaded_tokenizer("ab").input_ids == tokenizer("ab").input_ids
    torch.testing.assert_close(logits(reloaded, inputs), logits(model, inputs), rtol=0, atol=0)  # a round trip: bitwise


def test_a_llava_whose_language_model_is_not_llama_wired_is_refused():
    import transformers

    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                    num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8),
        text_config=transformers.GPTNeoXConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4),
        image_token_index=IMAGE_TOKEN, image_seq_length=4)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXModel language model"):
        compress_model(model, CompressConfig(method="svd", ratio=0.3), text_blocks(), progress=False)
