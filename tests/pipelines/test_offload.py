"""Loading a plain HF directory as owned copies (pipelines/offload.py ``load_as_copies``) equals transformers' load."""

from pathlib import Path

import pytest
import torch

from retrofitter.api import load_model
from retrofitter.adapters import auto_class_for
from retrofitter.pipelines.offload import SafetensorsCheckpoint, empty_model, load_as_copies

from tiny_models import FAMILIES, build_tiny, save_tiny_model_dir


def _mapped(path: Path) -> bool:
    return any(line.rstrip().endswith(str(path.resolve())) for line in open("/proc/self/maps"))


@pytest.mark.parametrize("family", FAMILIES)
def test_copies_equal_from_pretrained_in_every_tensor_and_logit(family, tmp_path):
    build_tiny(family).save_pretrained(tmp_path)
    copied = load_as_copies(tmp_path, torch.float32)
    stored = set(SafetensorsCheckpoint(tmp_path).files)
    renamed = family in ("gpt_neox", "llava", "llava_next")
    assert (copied is None) == renamed
    if copied is None:  # only when transformers renames the stored tensors (GPT-NeoX's embed_out, LLaVA)
        assert not stored <= set(empty_model(tmp_path, torch.float32).state_dict())
        return
    reference = auto_class_for(copied.config).from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = reference.state_dict()
    assert copied.state_dict().keys() == expected.keys()
    for key, value in copied.state_dict().items():
        assert torch.equal(value, expected[key]), key
    tokens = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same float32 weights (bitwise, above) and modules, but the reference's weights stay file-mapped,
        # only 8-byte aligned, and MKL documents alignment as able to change its order of operations: equal
        # up to float32 rounding of a tiny model's forward (inner dimensions <= 64, logits < 1: ~1e-6)
        torch.testing.assert_close(copied(input_ids=tokens).logits, reference(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    assert copied.generation_config.to_dict() == reference.generation_config.to_dict()
    if reference.config.tie_word_embeddings:
        assert copied.get_output_embeddings().weight is copied.get_input_embeddings().weight


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_load_model_keeps_no_mapping_of_the_weights_file(tmp_path):
    save_tiny_model_dir(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert not _mapped(tmp_path / "model.safetensors")
    assert all(not p.is_meta for p in model.parameters())


def test_another_stored_dtype_or_other_names_fall_back_to_transformers(tmp_path):
    build_tiny("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert load_as_copies(tmp_path / "bf16", torch.float32) is None
    assert load_as_copies(tmp_path / "bf16", torch.bfloat16) is not None
    from safetensors.torch import load_file, save_file

    build_tiny("llama").save_pretrained(tmp_path / "renamed")
    tensors = load_file(tmp_path / "renamed" / "model.safetensors")
    save_file({f"legacy.{k}": v for k, v in tensors.items()}, tmp_path / "renamed" / "model.safetensors",
              metadata={"format": "pt"})
    assert load_as_copies(tmp_path / "renamed", torch.float32) is None
