"""The healing loop on tiny models: it lowers the KL, resumes after an interruption, caches teacher top-k, 2 processes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retrofitter.config import CompressConfig, HealConfig
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.distill import kl_divergence_sum
from retrofitter.pipelines.heal import heal_model, learning_rate

from tiny_models import TINY_VOCAB, strong_tiny

SRC = Path(__file__).resolve().parents[2] / "src"


def blocks(n=8, length=32, seed=0):
    return torch.randint(3, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def pair(seed=0):
    """(teacher, student): a tiny model and its compressed copy."""
    teacher = strong_tiny("llama", seed=seed)
    student = strong_tiny("llama", seed=seed)
    compress_model(student, CompressConfig(ratio=0.4, batch_size=4, allocation="uniform", statistics="compressed"), blocks(4, 32, seed=9), progress=False)
    return teacher, student


def config(**overrides):
    base = dict(tokens=8 * 32, seq_len=32, batch_size=2, lr=1e-2, warmup_steps=1, lora_rank=4, lora_alpha=8.0,
                chunk_tokens=16, checkpoint_every=2, grad_clip=1.0)
    return HealConfig(**{**base, **overrides})


def mean_kl(student, teacher, ids):
    with torch.no_grad():
        return float(kl_divergence_sum(student(ids).logits, teacher(ids).logits)) / ids.numel()


def test_heal_lowers_the_kl_to_the_teacher_and_keeps_the_compressed_layout():
    teacher, student = pair()
    layout = {k: tuple(v.shape) for k, v in student.state_dict().items()}
    before = mean_kl(student, teacher, blocks())
    healed, report = heal_model(student, teacher, blocks(), config(tokens=3 * 8 * 32), progress=False)
    assert mean_kl(healed, teacher, blocks()) < 0.7 * before  # 3 epochs of the training blocks
    assert {k: tuple(v.shape) for k, v in healed.state_dict().items()} == layout
    assert any(isinstance(m, LatentLinear) for m in healed.modules())
    assert report["steps"] == 12 and report["tokens"] == 12 * 64 and report["stopped_by"] == "tokens"
    assert report["loss_last"] < report["loss_first"] and report["loss"] == "kl"
    assert not any(p.requires_grad for p in healed.parameters())


@pytest.mark.parametrize("requested, native", [("bfloat16", False), ("auto", True), ("auto", False)])
def test_heal_under_autocast_trains_in_that_dtype_and_merges_float32_weights(monkeypatch, requested, native):
    import retrofitter.pipelines.training as training

    monkeypatch.setattr(training, "native_bfloat16", lambda device: native)  # over conftest's False
    teacher, student = pair()
    before = mean_kl(student, teacher, blocks())
    seen = set()  # dtypes of the student's LatentLinear outputs while gradients are recorded (training steps)

    def record(module, args, output):
        if isinstance(module, LatentLinear) and torch.is_grad_enabled():
            seen.add(output.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        healed, report = heal_model(student, teacher, blocks(), config(tokens=3 * 8 * 32, autocast=requested),
                                    progress=False)
    finally:
        hook.remove()
    expected = "bfloat16" if requested == "bfloat16" or native else "float32"
    assert report["autocast"] == expected and seen == {getattr(torch, expected)}
    assert mean_kl(healed, teacher, blocks()) < 0.7 * before  # as in float32 (above)
    assert all(p.dtype == torch.float32 for p in healed.parameters())
    with pytest.raises(ValueError, match="autocast"):
        config(autocast="float16")


def test_control_distilled_from_itself_stays_close_to_the_original():
    # KL's gradient at student = teacher is zero; Adam scales rounding noise up to lr-sized steps, and the
    # KL then pulls back: the control stays far closer to the original than the compressed model is.
    teacher, student = pair()
    healed, report = heal_model(strong_tiny("llama"), teacher, blocks(), config(), progress=False)
    assert report["loss_history"][0] == pytest.approx(0.0, abs=1e-12)
    assert mean_kl(healed, teacher, blocks()) < 0.02 * mean_kl(student, teacher, blocks())


def test_learning_rate_warms_up_then_follows_the_cosine_to_its_floor():
    cfg = config(lr=1.0, warmup_steps=3, min_lr_ratio=0.1)
    assert [learning_rate(cfg, s, 0.0) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert learning_rate(cfg, 5, 0.0) == pytest.approx(1.0)
    assert learning_rate(cfg, 5, 0.5) == pytest.approx(0.55)
    assert learning_rate(cfg, 5, 1.0) == pytest.approx(0.1)


def test_heal_resumes_after_an_interruption_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    cfg = config(tokens=6 * 64)
    teacher, student = pair()
    reference, _ = heal_model(student, teacher, blocks(), cfg, progress=False)

    def interrupt(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    teacher, student = pair()
    with pytest.raises(KeyboardInterrupt):
        heal_model(student, teacher, blocks(), cfg, work_dir=tmp_path / "work", on_step=interrupt, progress=False)
    teacher, student = pair()
    resumed, report = heal_model(student, teacher, blocks(), cfg, work_dir=tmp_path / "work", progress=False)
    assert report["resumed_from_step"] == 2 and report["steps"] == 6 and len(report["loss_history"]) == 6
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    # a finished run in the work dir is not trained again
    teacher, student = pair()
    again, report = heal_model(student, teacher, blocks(), cfg, work_dir=tmp_path / "work", progress=False)
    assert report["stopped_by"] == "tokens" and report["resumed_from_step"] == 6
    # the finished run's saved adapters (bit for bit) merged into the same student by the same kernels: bitwise
    assert all(torch.equal(again.state_dict()[k], v) for k, v in resumed.state_dict().items())


def test_a_work_dir_of_other_settings_is_refused(tmp_path):
    teacher, student = pair()
    heal_model(student, teacher, blocks(), config(tokens=64), work_dir=tmp_path / "work", progress=False)
    teacher, student = pair()
    with pytest.raises(ValueError, match="different run"):
        heal_model(student, teacher, blocks(), config(tokens=128), work_dir=tmp_path / "work", progress=False)


def test_cached_teacher_topk_over_the_whole_vocabulary_trains_like_the_live_teacher(tmp_path):
    teacher, student = pair()
    live, _ = heal_model(student, teacher, blocks(), config(), progress=False)
    teacher, student = pair()
    cached, report = heal_model(student, teacher, blocks(), config(teacher_topk=TINY_VOCAB),
                                work_dir=tmp_path / "work", progress=False)
    assert (tmp_path / "work" / "teacher_topk" / "block_00007.safetensors").is_file()
    for key, value in live.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[key], value, rtol=1e-4, atol=1e-5)


def test_next_token_loss_alone_needs_no_teacher_and_a_minutes_budget_stops_training():
    _, student = pair()
    _, report = heal_model(student, None, blocks(), config(nll_weight=1.0, tokens=0, minutes=1e-9), progress=False)
    assert report["stopped_by"] == "minutes" and report["steps"] == 0 and report["loss"] == "next_token"
    with pytest.raises(ValueError, match="teacher"):
        heal_model(pair()[1], None, blocks(), config(), progress=False)


WORKER = textwrap.dedent("""
    import json, sys, torch
    from accelerate import Accelerator
    from safetensors.torch import save_file
    sys.path.insert(0, sys.argv[2])
    from test_heal import blocks, config, pair
    from retrofitter.pipelines.heal import heal_model

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    teacher, student = pair()
    healed, report = heal_model(student, teacher, blocks(), config(), accelerator=accelerator, progress=False)
    rank = accelerator.process_index
    save_file({k: v.contiguous() for k, v in healed.state_dict().items()}, f"{sys.argv[1]}/rank{rank}.safetensors")
    json.dump({k: report[k] for k in ("processes", "steps", "tokens")}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
""")


@pytest.mark.slow
def test_two_process_torchrun_heal_keeps_ranks_in_sync(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    tests_dir = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(Path(tests_dir).parent)]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
               str(script), str(tmp_path), tests_dir]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1] == {"processes": 2, "steps": 2, "tokens": 256}  # 8 blocks of 32, 2 x batch 2
    weights = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    _, untouched = pair()
    # both ranks apply the same all-reduced gradients with the same kernels to the same weights: bitwise
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["model.layers.0.self_attn.q_proj.up"],
                           untouched.state_dict()["model.layers.0.self_attn.q_proj.up"])
