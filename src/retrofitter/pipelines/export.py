"""Export: a converted model leaves retrofitter as files that other engines load with no retrofitter code.

* ``hf``: a model converted to MLA becomes a ``DeepseekV3ForCausalLM`` directory (adapters/deepseek_export.py
  holds the exact rewrite) — ``AutoModelForCausalLM.from_pretrained(path)`` loads it. The export checks
  itself: it loads the written directory with plain transformers and compares logits with the model's on a
  fixed input (max |Δ| / max |logit| ≤ ``PARITY_TOLERANCE``, float32), or removes it and fails.
* ``gguf``: the same directory through llama.cpp's own ``convert_hf_to_gguf.py`` (engines/llama_cpp.py: the
  converter of the llama.cpp build the tests run) to a GGUF of llama.cpp's ``deepseek2`` architecture. An
  unconverted model (plain transformers, e.g. the original) exports to its own architecture, as the reference.

Only f32 and bf16 GGUF weights hold an MLA export: the latent's RMSNorm is neutralised by scaling the latent
rows by α = 2⁻²⁸–2⁻²⁹ on SmolLM2-135M (deepseek_export.py), below float16's range; bfloat16 keeps float32's exponent range.
Outputs are written to a temporary sibling and renamed; an existing output is replaced only with
``overwrite`` and only when it is a previous export.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ..adapters.deepseek_export import ExportError, check_deepseek_exportable, deepseek_v3_checkpoint
from ..checkpoint import OutputExistsError, check_writable, replacement_records, staged_output
from ..engines.llama_cpp import EngineBuildError, build_llama_cpp, llama_cpp_python_dir, run_checked
from ..eval.llama_cpp import gguf_metadata
from ..modules.mla_attention import MLAAttention
from ..version import __version__

__all__ = ["EXPORT_FORMATS", "GGUF_OUTTYPES", "EXPORT_JSON", "PARITY_TOLERANCE", "check_export_output", "export_hf",
           "export_gguf", "export_model"]

EXPORT_FORMATS = ("hf", "gguf")
GGUF_OUTTYPES = ("f32", "bf16")
EXPORT_JSON = "retrofitter_export.json"  # provenance; not retrofitter.json: an export is not ours to load
PARITY_TOLERANCE = 1e-4
PARITY_TOKENS = 64


def _is_mla(model: nn.Module) -> bool:
    return any(isinstance(module, MLAAttention) for module in model.modules())


def check_export_output(out, overwrite: bool, fmt: str) -> None:
    """Before any work: ``out`` is new, or (with ``overwrite``) a previous export of the same format."""
    out = Path(out)
    check_writable(out, "--out")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise OutputExistsError(f"output {out} already exists; pass --overwrite (overwrite=True) to replace it")
    previous = (out / EXPORT_JSON).is_file() if fmt == "hf" else (out.is_file() and _is_gguf(out))
    if not previous:
        raise OutputExistsError(f"output {out} is not a previous {fmt} export: --overwrite replaces only those; move "
                                f"it away or choose another --out")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def _write_deepseek_dir(model: nn.Module, directory: Path, tokenizer) -> dict:
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    config_dict, state = deepseek_v3_checkpoint(model, dtype=torch.float32)
    DeepseekV3Config(**config_dict).save_pretrained(directory)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_side_files(model, directory, tokenizer)
    return config_dict


def _write_side_files(model: nn.Module, directory: Path, tokenizer) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)


@torch.no_grad()
def _parity(model: nn.Module, directory: Path) -> dict:
    """Logits of the written directory (plain transformers, float32) against ``model``'s on fixed ids."""
    from transformers import AutoModelForCausalLM

    parameter = next(model.parameters())
    if parameter.dtype not in (torch.float32, torch.float64):
        return {"checked": False, "reason": f"the model is in {parameter.dtype}; parity is checked in float32"}
    exported = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, trust_remote_code=False)
    exported.eval()
    vocab = exported.config.vocab_size
    ids = torch.randint(0, vocab, (1, PARITY_TOKENS), generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    reference = model(ids.to(parameter.device)).logits.float().cpu()
    model.train(was_training)
    logits = exported(ids).logits.float()
    error = float((logits - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    return {"checked": True, "tokens": PARITY_TOKENS, "max_rel_error": error, "tolerance": PARITY_TOLERANCE}


def export_hf(model: nn.Module, out, tokenizer=None, overwrite: bool = False, verify: bool = True,
              metadata: dict | None = None) -> dict:
    """Write ``model`` (converted to MLA) to ``out`` as a DeepSeek-V3 transformers directory; returns the
    export record (also written to ``out/retrofitter_export.json``)."""
    out = Path(out)
    if not _is_mla(model):
        raise ExportError("--format hf exports a model converted to MLA (retrofitter mla) as DeepSeek-V3; this "
                          "model has no MLA layers (an unconverted model already is a transformers model)")
    check_deepseek_exportable(model)
    check_export_output(out, overwrite, "hf")
    start = time.perf_counter()
    with staged_output(out) as tmp:
        config = _write_deepseek_dir(model, tmp, tokenizer)
        record = {"format": "hf", "architecture": "DeepseekV3ForCausalLM", "retrofitter_version": __version__,
                  "kv_lora_rank": config["kv_lora_rank"], "qk_rope_head_dim": config["qk_rope_head_dim"],
                  "qk_nope_head_dim": config["qk_nope_head_dim"], **(metadata or {})}
        if verify:
            record["parity"] = _parity(model, tmp)
            error = record["parity"].get("max_rel_error", 0.0)
            if error > PARITY_TOLERANCE:
                raise ExportError(f"the written DeepSeek-V3 model does not reproduce this model: logits differ by "
                                  f"{error:.2e} (relative; tolerance {PARITY_TOLERANCE:.0e}); nothing was written")
        record["seconds"] = round(time.perf_counter() - start, 2)
        (tmp / EXPORT_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def _convert_to_gguf(hf_dir: Path, target: Path, outtype: str) -> None:
    python_dir = llama_cpp_python_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(python_dir / "gguf-py"), str(python_dir)]))
    env.pop("NO_LOCAL_GGUF", None)
    command = [sys.executable, str(python_dir / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(target),
               "--outtype", outtype]
    run_checked(command, "llama.cpp's convert_hf_to_gguf.py", env=env)
    if not target.is_file():
        raise EngineBuildError(f"llama.cpp's convert_hf_to_gguf.py wrote no {target.name}")


def export_gguf(model: nn.Module, out, tokenizer, overwrite: bool = False, outtype: str = "f32",
                verify: bool = True, progress: bool = True, metadata: dict | None = None) -> dict:
    """Write ``model`` to the GGUF file ``out`` for llama.cpp: ``deepseek2`` when converted to MLA (through
    ``export_hf``), its own architecture when it is an unconverted transformers model. Builds llama.cpp's
    converter on first use (engines/llama_cpp.py)."""
    out = Path(out)
    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"--outtype {outtype!r}: supported {', '.join(GGUF_OUTTYPES)} (float16 cannot hold the "
                         f"scaled latent rows of an MLA export; see docs/export.md)")
    if tokenizer is None:
        raise ValueError("a GGUF export needs the model's tokenizer (llama.cpp tokenizes by itself)")
    mla = _is_mla(model)
    if mla:
        check_deepseek_exportable(model)
    elif replacement_records(model):
        raise ExportError("--format gguf exports a model converted to MLA, or an unconverted transformers model; "
                          "this model carries other retrofitter modules (compress / linearize), which no engine "
                          "format holds")
    check_export_output(out, overwrite, "gguf")
    build_llama_cpp(progress=progress)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.hf-", dir=out.parent) as scratch:
        hf_dir = Path(scratch) / "hf"
        if mla:
            record = export_hf(model, hf_dir, tokenizer, verify=verify, metadata=metadata)
            # a plain q projection: transformers wants q_lora_rank null, llama.cpp's loader requires the key
            # (0 = none) and its converter writes it only when it is not null
            config_path = hf_dir / "config.json"
            config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"q_lora_rank": 0}, indent=2))
        else:
            model.save_pretrained(hf_dir, safe_serialization=True)
            _write_side_files(model, hf_dir, tokenizer)
            record = {"architecture": type(model).__name__, "retrofitter_version": __version__, **(metadata or {})}
        staged = Path(scratch) / "model.gguf"
        _convert_to_gguf(hf_dir, staged, outtype)
        os.replace(staged, out)
    record.update(format="gguf", outtype=outtype, bytes=out.stat().st_size,
                  gguf_architecture=gguf_metadata(out)["general.architecture"],
                  seconds=round(time.perf_counter() - start, 2))
    return record


def export_model(model: nn.Module, out, fmt: str, tokenizer=None, overwrite: bool = False, outtype: str = "f32",
                 verify: bool = True, progress: bool = True, metadata: dict | None = None) -> dict:
    """``export_hf`` or ``export_gguf`` by ``fmt`` (one of ``EXPORT_FORMATS``)."""
    if fmt == "hf":
        return export_hf(model, out, tokenizer, overwrite=overwrite, verify=verify, metadata=metadata)
    if fmt == "gguf":
        return export_gguf(model, out, tokenizer, overwrite=overwrite, outtype=outtype, verify=verify,
                           progress=progress, metadata=metadata)
    raise ValueError(f"--format {fmt!r}: supported {', '.join(EXPORT_FORMATS)}")

