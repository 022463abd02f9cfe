"""What every job shares: the processes of the launch, the output lock, the save, the work directories.

A job that writes a model (compress, mla, linearize, heal, recall) runs (mla and recall in one process only,
``OutputJob.one_process``)::

    job = OutputJob.start(out, overwrite, eval_config, inputs, work_dirs, device=device)  # checks, rank
    with job.writing():                          # the output lock, held by rank 0 only
        model, tokenizer = load_checked(...)     # refuses lengths the model was never trained for
        ...convert...
        if not job.writes:                       # another process of a torchrun launch
            return job.rank_report(...)
        job.save(model, tokenizer, metadata, overwrite)  # rank 0; then the work directories go
        record = evaluate_record(...)            # eval.record.ResultsRecord; the job adds its sections
        return job.results(record)

Rank and world size are found one way (``find_processes``): ``RANK`` and ``WORLD_SIZE`` of the ``torchrun``
environment, the variables accelerate (heal, linearize) reads too; compress's data-parallel calibration
group is created from the same launch and must agree with them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..api import load_model, save
from ..checkpoint import is_retrofitted_dir, output_lock
from ..config import EvalConfig
from ..eval.record import ResultsRecord
from ..pipelines.distributed import SINGLE_PROCESS, DataParallel, data_parallel_from_env
from ..pipelines.resume import remove_work_dir
from ..preflight import check_context, check_outputs

__all__ = ["NO_EVAL", "Processes", "find_processes", "torchrun_rank", "OutputJob", "load_checked"]

NO_EVAL = EvalConfig(corpora=())  # accounting only, no perplexity


@dataclass(frozen=True)
class Processes:
    """This process's place in the launch: rank ``rank`` of ``world_size`` (0 of 1 outside ``torchrun``), and
    the data-parallel calibration group when the job asked for it (``SINGLE_PROCESS`` otherwise)."""

    rank: int = 0
    world_size: int = 1
    parallel: DataParallel = SINGLE_PROCESS

    @property
    def writes(self) -> bool:
        """Whether this process writes the output (rank 0)."""
        return self.rank == 0


def find_processes(device="cpu", *, calibration_group: bool = False) -> Processes:
    """The rank and world size of this process, for every job: ``torchrun`` sets ``WORLD_SIZE`` and ``RANK``
    (a process without ``WORLD_SIZE`` runs alone, rank 0 of 1). ``calibration_group``: also join the
    data-parallel calibration group (``pipelines.distributed.data_parallel_from_env``: gloo on CPU, NCCL on
    CUDA), refused if its rank or size differ from the environment's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else 0
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"the environment gives RANK {rank} of WORLD_SIZE {world}: launch the processes with "
                         f"torchrun, or unset RANK and WORLD_SIZE for one process")
    if not calibration_group:
        return Processes(rank, world)
    parallel = data_parallel_from_env(device)
    if (parallel.rank, parallel.world_size) != (rank, world):
        raise RuntimeError(f"the process group gives rank {parallel.rank} of {parallel.world_size}, the environment "
                           f"RANK {rank} of WORLD_SIZE {world}")
    return Processes(rank, world, parallel)


def torchrun_rank() -> int:
    """This process's rank in a ``torchrun`` launch (0 outside one): ``find_processes().rank``."""
    return find_processes().rank


def load_checked(model_name, lengths: dict, *, dtype="float32", device="cpu", quantize: str | None = None):
    """``(model, tokenizer)`` of ``model_name``, refused (naming the flag) when a sequence length of ``lengths``
    (flag -> tokens) exceeds the positions the model was trained for (``preflight.check_context``)."""
    model, tokenizer = load_model(str(model_name), dtype=dtype, device=device, quantize=quantize)
    check_context(model, lengths)
    return model, tokenizer


@dataclass
class OutputJob:
    """A job writing ``out``: its work directories (what -> path) and this process's place in the launch."""

    out: Path
    processes: Processes
    work_dirs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def start(cls, out, overwrite: bool, eval_config: EvalConfig, inputs: dict, work_dirs: dict | None = None, *,
              device="cpu", calibration_group: bool = False) -> OutputJob:
        """Before any work: ``preflight.check_outputs`` (``out`` may be written, no output or work directory
        touches an input of ``inputs``: flag -> path), then the processes (``find_processes``)."""
        out, work_dirs = Path(out), {what: Path(path) for what, path in (work_dirs or {}).items()}
        check_outputs(out, overwrite, eval_config, inputs, work_dirs)
        return cls(out, find_processes(device, calibration_group=calibration_group), work_dirs)

    @property
    def writes(self) -> bool:
        """Whether this process writes the output (rank 0)."""
        return self.processes.writes

    def one_process(self, command: str) -> OutputJob:
        """Refuse a launch of several processes for ``command``, whose work is not shared between processes
        (mla, recall): every process would repeat it. Returns the job."""
        if self.processes.world_size > 1:
            raise ValueError(f"retrofitter {command} runs in one process; launch it without torchrun "
                             f"(WORLD_SIZE is {self.processes.world_size})")
        return self

    @property
    def parallel(self) -> DataParallel:
        """The data-parallel calibration group (``calibration_group=True``), else ``SINGLE_PROCESS``."""
        return self.processes.parallel

    @contextlib.contextmanager
    def writing(self):
        """Hold the output lock (``checkpoint.output_lock``) for the job, on rank 0 only: the other processes of
        a launch write nothing."""
        with output_lock(self.out) if self.writes else contextlib.nullcontext():
            yield self

    def rank_report(self, **report) -> dict:
        """What a process other than rank 0 returns: its rank, the number of processes and its own ``report``."""
        return {"rank": self.processes.rank, "processes": self.processes.world_size, **report}

    def save(self, model, tokenizer, metadata: dict, overwrite: bool, remove=None) -> Path:
        """Rank 0: save ``model`` to ``out`` (atomically), then ``remove_work_dirs(remove)``."""
        if not self.writes:
            raise RuntimeError(f"rank {self.processes.rank} may not write {self.out}: rank 0 writes the output")
        path = save(model, self.out, tokenizer=tokenizer, metadata=metadata, overwrite=overwrite)
        self.remove_work_dirs(remove)
        return path

    def remove_work_dirs(self, remove=None) -> None:
        """Remove what retrofitter wrote in the work directories ``remove`` (default: all of the job's), only
        once ``out`` is in place: until then they hold the progress a rerun resumes from."""
        if not is_retrofitted_dir(self.out):
            raise RuntimeError(f"{self.out} is not in place: its work directories are kept to resume from")
        for path in self.work_dirs.values() if remove is None else remove:
            remove_work_dir(path)

    def results(self, record: ResultsRecord) -> dict:
        """The job's return value: ``record`` with the ``out`` section, as the dict ``--json`` writes."""
        record.add_sections(out=str(self.out))
        return record.to_dict()
