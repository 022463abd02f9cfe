"""Reference factors of the compression pipeline on tiny models (the "results reproduce" check).

``CASES`` lists (name, family, config fields, statistics source); ``run_case`` compresses a fixed
tiny model on fixed calibration tokens and returns the model's state dict. The files in
``golden/`` were written by ``python tests/pipelines/golden_cases.py`` with the code before the
single-loop refactor; ``test_golden.py`` asserts that today's code gives the same tensors.
Regenerate them only for an intended numerical change, and say so in the commit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import TINY_VOCAB, strong_tiny

GOLDEN_DIR = Path(__file__).parent / "golden"

CASES = {
    "llama-rootcov-uniform": ("llama", {"method": "asvd-rootcov", "ratio": 0.3, "allocation": "uniform",
                                        "statistics": "compressed"}),
    "opt-rootcov-uniform": ("opt", {"method": "asvd-rootcov", "ratio": 0.3, "allocation": "uniform",
                                    "statistics": "compressed"}),
    "qwen3-cov-uniform-teacher": ("qwen3", {"method": "asvd-cov", "ratio": 0.2, "statistics": "teacher",
                                            "allocation": "uniform"}),
    "llama-rootcov-global": ("llama", {"method": "asvd-rootcov", "ratio": 0.3, "allocation": "global",
                                       "statistics": "compressed"}),
    # down_fit="ridge": the down fit these files were written with (the default is now "anchored")
    "llama-latentllm": ("llama", {"method": "latentllm", "ratio": 0.3, "down_fit": "ridge"}),
    "opt-latentllm": ("opt", {"method": "latentllm", "ratio": 0.3, "down_fit": "ridge"}),
    "qwen2-latentllm-uniform-vo": ("qwen2", {"method": "latentllm", "ratio": 0.3, "allocation": "uniform",
                                             "joint_vo": True, "down_fit": "ridge"}),
    "llama-latentllm-auxiliary-teacher": ("llama", {"method": "latentllm", "ratio": 0.3, "allocation": "uniform",
                                                    "mlp_algorithm": "auxiliary", "statistics": "teacher",
                                                    "mlp_aux_tokens": 128}),
}


def calibration_tokens() -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(7))


def run_case(name: str, compress) -> dict[str, torch.Tensor]:
    """State dict of the case's model after ``compress(model, config, tokens)``."""
    from retrofitter.config import CompressConfig

    family, fields = CASES[name]
    model = strong_tiny(family)
    compress(model, CompressConfig.from_flat(dict(batch_size=4, **fields)), calibration_tokens())
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    import sys

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from retrofitter.api import compress as api_compress

    torch.set_num_threads(1)
    GOLDEN_DIR.mkdir(exist_ok=True)
    for case in CASES:
        state = run_case(case, lambda m, c, t: api_compress(m, c, t, progress=False))
        save_file(state, str(GOLDEN_DIR / f"{case}.safetensors"))
        print(case, len(state))
