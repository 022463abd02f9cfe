"""The job scaffold: one way to find the rank (the same for compress's process group and heal/linearize's
environment), the lock and the save on rank 0 only, work directories removed only once the output is there."""

import ast
import os
import socket
from pathlib import Path

import pytest
import torch

import retrofitter.jobs as jobs
from retrofitter.jobs.scaffold import OutputJob, Processes, find_processes, torchrun_rank
from retrofitter.pipelines.distributed import SINGLE_PROCESS

JOBS = Path(jobs.__file__).parent


def test_outside_torchrun_every_job_is_rank_0_of_1(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")  # a stray RANK without a launch: one process
    assert find_processes() == Processes(0, 1) and torchrun_rank() == 0
    assert find_processes(calibration_group=True) == Processes(0, 1, SINGLE_PROCESS)


def test_a_fake_launch_gives_the_group_and_the_environment_the_same_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # the group of this fake launch
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    compress = find_processes("cpu", calibration_group=True)  # what compress_job uses
    assert (compress.rank, compress.world_size) == (compress.parallel.rank, compress.parallel.world_size) == (1, 2)
    assert find_processes() == Processes(1, 2) and torchrun_rank() == 1  # what heal and linearize use
    assert not compress.writes
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)  # a group that disagrees is refused
    with pytest.raises(RuntimeError, match="rank 0 of 2, the environment RANK 1"):
        find_processes(calibration_group=True)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK 2 of WORLD_SIZE 2"):
        find_processes()


def _report_ranks(rank: int, world: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    group = find_processes("cpu", calibration_group=True)  # initialises the gloo group, as compress does
    results.put((rank, group.rank, group.parallel.rank, group.parallel.world_size, torchrun_rank()))
    torch.distributed.destroy_process_group()


def test_a_real_two_process_launch_gives_each_process_one_rank_everywhere():
    context = torch.multiprocessing.get_context("spawn")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    results = context.Queue()
    processes = [context.Process(target=_report_ranks, args=(rank, 2, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    found = sorted(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert found == [(0, 0, 0, 2, 0), (1, 1, 1, 2, 1)]


def test_other_ranks_neither_lock_nor_save_and_work_dirs_wait_for_the_output(tmp_path):
    work = tmp_path / ".out.partial"
    second = OutputJob(tmp_path / "out", Processes(1, 2), {"the resume directory": work})
    with second.writing():
        assert not (tmp_path / ".out.lock").exists()
        with pytest.raises(RuntimeError, match="rank 0 writes"):
            second.save(torch.nn.Linear(2, 2), None, {}, overwrite=False)
    assert second.rank_report(heal={"steps": 2}) == {"rank": 1, "processes": 2, "heal": {"steps": 2}}
    first = OutputJob(tmp_path / "out", Processes(0, 1), {"the resume directory": work})
    with first.writing():
        assert (tmp_path / ".out.lock").exists()
        with pytest.raises(RuntimeError, match="not in place"):
            first.remove_work_dirs()
    assert not (tmp_path / ".out.lock").exists()


def test_one_process_jobs_refuse_a_launch_of_several(tmp_path, monkeypatch):
    assert OutputJob(tmp_path / "out", Processes(0, 1)).one_process("mla").processes == Processes(0, 1)
    with pytest.raises(ValueError, match="retrofitter mla runs in one process; launch it without torchrun"):
        OutputJob(tmp_path / "out", Processes(0, 2)).one_process("mla")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the launch as the job finds it, before any model is loaded
    with pytest.raises(ValueError, match="retrofitter recall runs in one process"):
        OutputJob.start(tmp_path / "r", False, jobs.NO_EVAL, {}).one_process("recall")


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names})


@pytest.mark.parametrize("path", sorted(p.name for p in JOBS.glob("*.py") if p.name != "scaffold.py"))
def test_only_the_scaffold_finds_ranks_and_removes_work_dirs(path):
    used = _names_used(JOBS / path)
    assert not used & {"environ", "getenv", "data_parallel_from_env", "remove_work_dir", "check_outputs"}, path
    # export writes through api.export and sample writes a text file: neither has a results record or work directory
    if path not in ("export.py", "sample.py"):
        assert "output_lock" not in used, path
