"""eval/machine.py: the CPU's model name and flags from cpuinfo, and whether bfloat16 is native."""

import torch

from retrofitter.eval.machine import BFLOAT16_CPU_FLAGS, cpu_flags, cpu_model, native_bfloat16

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f {extra}

processor\t: 1
model name\t: another core
flags\t\t: fpu
"""


def _cpuinfo(tmp_path, extra: str) -> str:
    path = tmp_path / f"cpuinfo-{len(extra)}"
    path.write_text(CPUINFO.format(extra=extra))
    return str(path)


def test_the_first_cpus_model_and_flags_are_read(tmp_path):
    path = _cpuinfo(tmp_path, "amx_bf16 amx_tile")
    assert cpu_model(path) == "Intel(R) Xeon(R) Processor"
    assert cpu_flags(path) == {"fpu", "sse2", "avx2", "avx512f", "amx_bf16", "amx_tile"}


def test_bfloat16_is_native_on_a_cpu_with_either_flag_and_not_without(tmp_path):
    for flag in sorted(BFLOAT16_CPU_FLAGS):
        assert native_bfloat16("cpu", _cpuinfo(tmp_path, flag))
    assert not native_bfloat16("cpu", _cpuinfo(tmp_path, "avx512_vnni"))  # a neighbour of the flags is not one
    assert not native_bfloat16("meta", _cpuinfo(tmp_path, "amx_bf16"))  # flags describe the CPU only


def test_a_machine_without_cpuinfo_answers_not_native(tmp_path):
    missing = str(tmp_path / "no-such-file")
    assert cpu_flags(missing) == frozenset() and not native_bfloat16("cpu", missing)
    assert cpu_model(missing)  # platform's answer instead


def test_a_cuda_device_answers_for_itself():
    expected = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert native_bfloat16("cuda") == expected
