"""Run the public command line from a benchmark: ``python -m retrofitter ARGS`` in a child process, timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_retrofitter(args: list[str], *, threads: int | None = None, log: Path | None = None,
                    launcher: list[str] | None = None) -> float:
    """Wall seconds of ``python -m retrofitter ARGS`` (``launcher`` replaces ``python``, e.g. torchrun's
    ``python -m torch.distributed.run ...``) with ``threads`` OpenMP threads per process. Its output is
    appended to ``log`` (else captured and shown only on failure); a failure stops the benchmark."""
    command = [*(launcher or [sys.executable]), "-m", "retrofitter", *args]
    # src first; a PYTHONPATH already set (packages installed beside the environment) stays after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    if log is None:
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        detail = done.stderr[-3000:]
    else:
        with log.open("a") as handle:
            handle.write(f"\n$ {' '.join(command)}\n")
            handle.flush()
            done = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
        detail = f"see {log}"
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{detail}")
    return time.perf_counter() - start


def run_once(result: Path, args: list[str], *, threads: int | None = None, log: Path | None = None) -> dict:
    """The results JSON of ``retrofitter ARGS --json result`` with its wall seconds added as ``wall_s``; a
    ``result`` that exists is read instead of running again (benchmarks resume point by point)."""
    if not result.exists():
        seconds = run_retrofitter([*args, "--json", str(result)], threads=threads, log=log)
        record = json.loads(result.read_text())
        record["wall_s"] = seconds
        result.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    return json.loads(result.read_text())
