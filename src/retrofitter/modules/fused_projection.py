"""FusedProjection: one fused ``nn.Linear`` (q/k/v, gate/up, ...) split into named parts.

Some families compute several projections of the same input with one matrix: Phi-3's ``qkv_proj``
([q; k; v]) and ``gate_up_proj`` ([gate; up]), GPT-NeoX's ``query_key_value`` ([q_0 k_0 v_0 q_1 k_1 v_1
...], interleaved per head). ``FusedProjection`` holds each part as its own module (``nn.Linear``, or
``LatentLinear`` after compression) under its own name, so each can be compressed, hooked and saved
like any other projection, and reproduces the fused output layout:

    x [..., d]  →  y [..., Σ_j w_j],   y = concat over groups i of [part_1(x)_i, part_2(x)_i, ...]

where part_j(x) [..., w_j] is cut into ``groups`` equal slices part_j(x)_i [..., w_j / groups]
(``groups = 1``: plain concatenation [part_1(x), part_2(x), ...]; GPT-NeoX: groups = heads).

While every part is a plain, unhooked ``nn.Linear`` the forward is one ``F.linear`` with the
re-assembled fused weight, i.e. the original computation bit for bit; otherwise (a compressed,
quantized or LoRA-wrapped part, or forward hooks on a part: pipelines observe the parts' inputs) each
part runs as a module of its own and the outputs are interleaved (a pure permutation of output
entries; equal to the fused product up to float rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedProjection"]


class FusedProjection(nn.Module):
    """Named parts of a fused projection; see the module docstring.

    Args:
        parts: part name -> module with ``in_features`` / ``out_features`` (the order is the fused order).
        groups: number of interleaved groups; every part's width must be a multiple of it.
    """

    def __init__(self, parts: dict[str, nn.Module], groups: int = 1):
        super().__init__()
        if not parts:
            raise ValueError("a FusedProjection needs at least one part")
        self.groups = int(groups)
        self.part_names = tuple(parts)
        widths = [int(module.out_features) for module in parts.values()]
        inputs = {int(module.in_features) for module in parts.values()}
        if len(inputs) != 1:
            raise ValueError(f"the parts of a fused projection read one input; got in_features {sorted(inputs)}")
        bad = [name for name, width in zip(parts, widths) if width % self.groups]
        if self.groups < 1 or bad:
            raise ValueError(f"part widths {dict(zip(parts, widths))} are not multiples of groups={groups}")
        for name, module in parts.items():
            setattr(self, name, module)
        self.in_features = inputs.pop()
        self.out_features = sum(widths)

    @classmethod
    def split(cls, linear: nn.Linear, widths: dict[str, int], groups: int = 1) -> "FusedProjection":
        """Split ``linear`` (W [Σ w_j, d], b) into parts of total widths ``widths`` (name -> w_j), exactly."""
        if sum(widths.values()) != linear.out_features:
            raise ValueError(f"part widths {widths} do not add up to the {linear.out_features} outputs of {linear}")
        rows = _part_rows(tuple(widths.values()), groups)
        parts = {}
        for (name, width), index in zip(widths.items(), rows):
            part = nn.Linear(linear.in_features, width, bias=linear.bias is not None,
                             dtype=linear.weight.dtype, device=linear.weight.device)
            with torch.no_grad():
                part.weight.copy_(linear.weight[index.to(linear.weight.device)])
                if linear.bias is not None:
                    part.bias.copy_(linear.bias[index.to(linear.bias.device)])
            part.weight.requires_grad_(linear.weight.requires_grad)
            parts[name] = part
        return cls(parts, groups)

    def parts(self) -> dict[str, nn.Module]:
        """Part name -> module, in the fused order."""
        return {name: getattr(self, name) for name in self.part_names}

    def widths(self) -> dict[str, int]:
        return {name: int(module.out_features) for name, module in self.parts().items()}

    def fused_rows(self) -> list[torch.Tensor]:
        """Per part, the rows [w_j] of the fused output it fills (long tensors)."""
        return _part_rows(tuple(self.widths().values()), self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.parts().values())
        if all(type(module) is nn.Linear and type(module.weight) is nn.Parameter and not _hooked(module)
               for module in parts):
            weight, bias = self._fused_parameters(parts)
            return F.linear(x, weight, bias)
        outputs = [module(x) for module in parts]  # [..., w_j]
        if self.groups == 1:
            return torch.cat(outputs, dim=-1)
        grouped = [y.reshape(*y.shape[:-1], self.groups, -1) for y in outputs]  # [..., groups, w_j / groups]
        return torch.cat(grouped, dim=-1).reshape(*x.shape[:-1], self.out_features)

    def _fused_parameters(self, parts: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused W [Σ w_j, d] and b of dense parts, rows in the fused order."""
        def fuse(tensors):
            if self.groups == 1:
                return torch.cat(tensors, dim=0)
            grouped = [t.reshape(self.groups, -1, *t.shape[1:]) for t in tensors]
            return torch.cat(grouped, dim=1).reshape(self.out_features, *tensors[0].shape[1:])

        weight = fuse([module.weight for module in parts])
        biases = [module.bias for module in parts]
        if all(b is None for b in biases):
            return weight, None
        biases = [b if b is not None else weight.new_zeros(m.out_features) for b, m in zip(biases, parts)]
        return weight, fuse(biases)

    def spec(self) -> dict:
        """Constructor facts for ``retrofitter.json``: ``parts`` [[name, width], ...] in the fused order (a
        list: JSON objects are written with sorted keys) and ``groups``."""
        return {"parts": [[name, width] for name, width in self.widths().items()], "groups": self.groups}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}"


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks, which only run when it is called itself."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _part_rows(widths: tuple[int, ...], groups: int) -> list[torch.Tensor]:
    """Rows of the fused output filled by each part (widths w_j, ``groups`` interleaved groups)."""
    if any(w % groups for w in widths):
        raise ValueError(f"part widths {widths} are not multiples of groups={groups}")
    slices = [w // groups for w in widths]
    stride = sum(slices)
    rows = []
    offset = 0
    for size in slices:
        starts = torch.arange(groups) * stride + offset  # [groups]
        rows.append((starts[:, None] + torch.arange(size)[None, :]).reshape(-1))
        offset += size
    return rows
