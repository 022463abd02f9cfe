"""Teacher statistics kept on disk between the rank plan and the fits: one statistics pass instead of two.

With ``statistics="teacher"`` every layer is fitted on the *original* model's activations, so the input
second moments the global rank plan collects (allocation.global_plan: one pass of the original layers) are
exactly the ones the fits need. Without this store the compression loop collects them a second time (a
second pass of every layer with float64 accumulation: about a third of the compression time on
SmolLM2-135M). Holding them in memory would cost d² float64 per distinct input per layer, the whole model's
worth at once (800 MiB for SmolLM2-135M: more than its fp32 weights), so each layer's moments go to one
safetensors file as soon as the plan pass leaves that layer and come back when the loop reaches it:

    spill = MomentSpill(directory)
    planner = make_planner(..., keep_moments=spill.put)   # layer l: name -> accumulator, written at once
    run_sequential(..., precomputed=spill)                # spill[l]: name -> accumulator, read back

The files hold the running sums bit for bit (``SecondMomentAccumulator.state_dict``), so the fits equal
those of the two-pass loop exactly. Projections sharing an input share one file entry.

The plan may also hand over each matrix's full weighted SVD (``linalg.svd.WeightedSVD``: U, S and A = V P⁺),
which it computed for the spectrum anyway; ``weighted_svds(l)`` reads them back, so the fits only truncate
(no second eigendecomposition or SVD). On disk that is about 2–4× a layer's fp32 weights in float64 beside
the moments, one file per layer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from ..linalg.moments import SecondMomentAccumulator
from ..linalg.svd import WeightedSVD

__all__ = ["MomentSpill"]


class MomentSpill(Mapping):
    """layer index -> {projection name -> ``SecondMomentAccumulator``}, one file per layer in a private
    temporary directory under ``parent`` (the system's temporary directory by default), removed by
    :meth:`close` (or on leaving a ``with`` block)."""

    def __init__(self, parent: str | Path | None = None, device="cpu"):
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=".retrofitter-moments-", dir=parent))
        self.device = device
        self._layers: set[int] = set()
        self.bytes_written = 0

    def _file(self, index: int) -> Path:
        return self.path / f"layer_{index}.safetensors"

    def put(self, index: int, moments: dict[str, SecondMomentAccumulator],
            svds: dict[str, WeightedSVD] | None = None) -> None:
        """Write layer ``index``'s moments (projection name -> accumulator; names sharing an accumulator
        share its entry), after checking they are finite, and the weighted SVDs ``svds`` (name -> SVD)."""
        keys: dict[int, str] = {}  # id(accumulator) -> file key
        names: dict[str, str] = {}  # projection name -> file key
        tensors = {}
        for name, accumulator in moments.items():
            if id(accumulator) not in keys:
                accumulator.check_finite(f"layer {index} input of {name!r}")
                keys[id(accumulator)] = key = str(len(keys))
                tensors.update({f"{key}.{field}": t for field, t in accumulator.state_dict().items()})
            names[name] = keys[id(accumulator)]
        for name, svd in (svds or {}).items():
            tensors.update({f"svd.{name}.U": svd.U, f"svd.{name}.S": svd.S, f"svd.{name}.A": svd.A})
        target = self._file(index)
        tmp = target.with_name(f".{target.name}.tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata={"names": json.dumps(names), "svds": json.dumps(sorted(svds or {}))})
        tmp.replace(target)
        self.bytes_written += target.stat().st_size
        self._layers.add(index)

    def __getitem__(self, index: int) -> dict[str, SecondMomentAccumulator]:
        if index not in self._layers:
            raise KeyError(f"no teacher moments stored for layer {index}")
        with safe_open(str(self._file(index)), framework="pt", device="cpu") as handle:
            names = json.loads(handle.metadata()["names"])
            loaded: dict[str, SecondMomentAccumulator] = {}
            for key in sorted(set(names.values())):
                state = {field: handle.get_tensor(f"{key}.{field}") for field in ("weighted_sum", "weighted_outer", "count")}
                loaded[key] = SecondMomentAccumulator.from_state_dict(state, device=self.device)
        return {name: loaded[key] for name, key in names.items()}

    def weighted_svds(self, index: int) -> dict[str, WeightedSVD]:
        """Layer ``index``'s weighted SVDs as put (name -> SVD), or {}."""
        if index not in self._layers:
            raise KeyError(f"no teacher moments stored for layer {index}")
        with safe_open(str(self._file(index)), framework="pt", device="cpu") as handle:
            return {name: WeightedSVD(*(handle.get_tensor(f"svd.{name}.{part}").to(self.device)
                                        for part in ("U", "S", "A")))
                    for name in json.loads(handle.metadata().get("svds", "[]"))}

    def __iter__(self):
        return iter(sorted(self._layers))

    def __len__(self) -> int:
        return len(self._layers)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._layers.clear()

    def __enter__(self) -> "MomentSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
