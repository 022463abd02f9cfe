"""What this machine is and what it runs natively: the CPU's model name and whether bfloat16 math is native.

Linux describes each CPU in ``/proc/cpuinfo``: a ``model name`` line and a ``flags`` line (x86). Native bfloat16
on x86 CPUs is ``avx512_bf16`` (AMD Zen 4, Intel Cooper Lake on) or ``amx_bf16`` (Intel Sapphire Rapids on); where
neither is there, PyTorch emulates bfloat16 matmuls through float32 and they run slower than float32 ones. On CUDA
the device says (``torch.cuda.is_bf16_supported``). Anything else (macOS, ARM, MPS) is answered "not native", the
safe choice: float32 is never the slow path.
"""

from __future__ import annotations

import platform

import torch

__all__ = ["BFLOAT16_CPU_FLAGS", "cpu_flags", "cpu_model", "native_bfloat16"]

BFLOAT16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = "/proc/cpuinfo"


def _cpuinfo_field(name: str, cpuinfo: str) -> str | None:
    """The value of the first ``name : value`` line of ``cpuinfo`` (a path), or None (no file, no such line)."""
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model(cpuinfo: str = CPUINFO) -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), or what ``platform`` knows where there is no cpuinfo."""
    return _cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags (x86 Linux); empty where the file or the line is missing."""
    return frozenset((_cpuinfo_field("flags", cpuinfo) or "").split())


def native_bfloat16(device: torch.device | str, cpuinfo: str = CPUINFO) -> bool:
    """Whether bfloat16 matmuls run natively on ``device``: a CUDA device that supports them, or a CPU with
    ``BFLOAT16_CPU_FLAGS``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags(cpuinfo) & BFLOAT16_CPU_FLAGS)
