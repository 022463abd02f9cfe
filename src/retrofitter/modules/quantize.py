"""Post-training int8 quantization (torchao) of every projection, LatentLinear factors included.

Schemes (``QUANTIZE_SCHEMES``: name -> ``QuantizeScheme``), for a weight W [n, k] read as y = x Wᵀ + b:

* ``int8-weight`` (torchao ``Int8WeightOnlyConfig``): W ≈ diag(s) q, q int8 [n, k], s [n] (symmetric, one
  scale per output row); y = (x qᵀ) ⊙ s + b computed in the activation dtype.
* ``int8-dynamic`` (``Int8DynamicActivationInt8WeightConfig``): W as above and, at run time, each token
  x [k] ≈ t p with p int8 [k], t a scalar; y = (p qᵀ)_int32 · t ⊙ s + b (int8 × int8 matmul).

What is quantized: every weight read through ``F.linear`` by an ``nn.Linear`` (``weight`` [d', d]) or a
``LatentLinear`` (``up`` [d', r] and ``mix`` [r, d − r], or ``down`` [r, d] in plain form: each factor
is quantized per row exactly like a Linear's weight). Each tensor is replaced *in place*, under the
same attribute, by torchao's ``Int8Tensor`` (a tensor subclass with inner tensors ``qdata``,
``scale``, ...), so module types and state-dict keys do not change and ``F.linear`` dispatches to
torchao's int8 kernel. Which attributes of which module are weights is the registry
``QUANTIZABLE_WEIGHTS`` (module type -> attribute names). Left in the load dtype: embeddings and the
LM head (``model.get_output_embeddings()``, often tied to the embeddings), norms, biases, the index
buffers of junction factors, weights a module reads directly rather than through ``F.linear``
(declared by its ``directly_read_weights()``: the k/v decompressions of an absorbed ``LatentAttention``),
and single-column weights (k = 1, e.g. a rank-1 ``up``: per-row int8 would store more than the float
column, and torchao 0.18 fails on them).

Stored bytes of a quantized weight are those of its inner tensors (``eval.accounting.stored_bytes``
sums them): n·k (int8 q) + 4n (s [n, 1], float32 whatever the model's dtype) + n (int8 zero points
[n, 1], all 0: torchao keeps them even for the symmetric mapping), i.e. n·k + 5n bytes. A quantized
model is for evaluation and inference: it cannot be saved (``checkpoint`` refuses it), nor trained.
The schemes run on CPU (checked by the tests) and, per torchao's documentation, on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .latent_linear import LatentLinear

__all__ = ["QUANTIZE_SCHEMES", "QUANTIZABLE_WEIGHTS", "QuantizeScheme", "quantize_model", "quantized_scheme",
           "check_scheme"]

SCHEME_ATTRIBUTE = "retrofitter_quantize"  # set on a quantized model: the scheme's name


@dataclass(frozen=True)
class QuantizeScheme:
    """A torchao config (built on demand: importing torchao takes seconds) and the devices it runs on."""

    config_name: str  # class name in torchao.quantization
    devices: tuple[str, ...]
    description: str

    def config(self):
        return getattr(_torchao(), self.config_name)()


QUANTIZE_SCHEMES: dict[str, QuantizeScheme] = {
    "int8-weight": QuantizeScheme("Int8WeightOnlyConfig", ("cpu", "cuda"),
                                  "int8 weights, one fp scale per row; matmul in the activation dtype"),
    "int8-dynamic": QuantizeScheme("Int8DynamicActivationInt8WeightConfig", ("cpu", "cuda"),
                                   "int8 weights and per-token dynamically quantized int8 activations"),
}
# torchao 0.18 int4 weight-only (Int4WeightOnlyConfig) has no CPU kernel; it is not offered.

QUANTIZABLE_WEIGHTS: dict[type, Callable[[nn.Module], tuple[str, ...]]] = {
    nn.Linear: lambda module: ("weight",),
    LatentLinear: lambda module: ("up", "mix" if module.junction else "down"),
}


def _torchao():
    """``torchao.quantization`` (imported on first use; transformers imports it too when it is installed)."""
    try:
        import torchao.quantization as quantization
    except ImportError as error:
        raise ImportError("quantization needs torchao: pip install torchao (see requirements.txt)") from error
    return quantization


def check_scheme(scheme: str, device: str = "cpu") -> QuantizeScheme:
    """The registered ``scheme``; ValueError naming the choices when it is unknown or cannot run on ``device``."""
    if scheme not in QUANTIZE_SCHEMES:
        raise ValueError(f"unknown quantize scheme {scheme!r}; choose from {', '.join(sorted(QUANTIZE_SCHEMES))}")
    entry = QUANTIZE_SCHEMES[scheme]
    if device not in entry.devices:
        usable = sorted(name for name, s in QUANTIZE_SCHEMES.items() if device in s.devices)
        raise ValueError(f"quantize scheme {scheme!r} does not run on {device}; schemes for {device}: "
                         f"{', '.join(usable) or 'none'}")
    return entry


def quantized_scheme(model: nn.Module) -> str | None:
    """The scheme ``quantize_model`` applied to ``model``, or None."""
    return getattr(model, SCHEME_ATTRIBUTE, None)


def _weight_names(module: nn.Module) -> tuple[str, ...]:
    for module_type, names in QUANTIZABLE_WEIGHTS.items():
        if isinstance(module, module_type):
            return names(module)
    return ()


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Quantize ``model``'s projection weights in place with ``scheme`` (see the module docstring); returns it.

    A tensor shared by several modules is quantized once and stays shared.
    """
    if quantized_scheme(model) is not None:
        raise ValueError(f"the model is already quantized ({quantized_scheme(model)})")
    first = next(model.parameters())
    config = check_scheme(scheme, first.device.type).config()
    quantize_ = _torchao().quantize_
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    keep = {id(t) for m in model.modules() if hasattr(m, "directly_read_weights") for t in m.directly_read_weights()}
    done: dict[int, nn.Parameter] = {}  # id(original) -> its quantized replacement
    for module in list(model.modules()):
        if module is head:
            continue
        for name in _weight_names(module):
            weight = getattr(module, name)
            if id(weight) in keep or weight.shape[1] < 2:
                continue
            if id(weight) not in done:
                carrier = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                carrier.weight = weight  # [out, in]: the factor is the weight of an F.linear
                quantize_(carrier, config)
                done[id(weight)] = carrier.weight
            setattr(module, name, done[id(weight)])
    setattr(model, SCHEME_ATTRIBUTE, scheme)
    return model
