"""LatentLLM ablation on the default model: which part brings the gain (design.md §3).

Variants ("parts"), each at every ratio, same total linear-parameter budget:

    rootcov_plain     local rootcov (compress.py), plain factors r(d+d'), uniform ranks
    rootcov           local rootcov with junction (more rank at the same parameter count), uniform
    joint_qk          latentllm pipeline: + joint QK only (V/O, MLP local), uniform
    joint_ud          + joint QK + streaming joint MLP (down refitted to the compressed intermediate), uniform
    joint_vo          + joint VO as well, uniform
    rootcov_global_fisher    local rootcov, global allocation priced by loss gradients ("fisher")
    latentllm_global_fisher  joint QK + joint UD with global "fisher" allocation (= ``--method latentllm``)
    latentllm_global_fisher_joint_qk_only / _joint_ud_only   one joint part, the other local, same allocation
    latentllm_global_fisher_anchored  the joint down map damped towards W_d instead of towards zero (ridge)
    latentllm_global_fisher_select    per layer, anchored joint or local down fit by held-out calibration error
    latentllm_global_fisher_anchored_teacher_target   anchored, every fit (joint ones too) reproduces the
                      original's outputs from the compressed inputs (--statistics teacher_target)
    rootcov_global    local rootcov, global allocation with the "relative" weighting
    latentllm_global_fisher_kv50  latentllm with a second budget: latent k/v widths <= 0.5 x the original KV
    latentllm_global_fisher_anchored_kv50  the same with the anchored down fit (--method latentllm --kv-ratio 0.5)
    rootcov_refit     local rootcov, each group's statistics after the groups before it are replaced, uniform
    rootcov_teacher_target                 local rootcov fitted to the original's outputs, uniform ranks
    rootcov_global_fisher_teacher_target   the same with global fisher allocation
    latentllm_global  joint QK + joint UD, global "relative" allocation
    qk_sweep          q,k only, QK iterations 1..8 and local rootcov (the solver's starting point):
                      mean proxy score error vs perplexity

    python benchmarks/compress_ablation.py --ratios 0.2 --parts rootcov,latentllm_global_fisher
    python benchmarks/compress_ablation.py --only rootcov@0.3,joint_qk@0.3,qk_sweep@0.3 --threads 1

Every part states all of its switches, so changing a CompressConfig default does not change a row.
Several processes may write the same ``--out`` (rows are merged under a file lock); run two with
``--threads 1`` to use two cores.

Writes benchmarks/results/compress_ablation.json and .md (rows are merged with earlier runs by
(part, ratio, extra), so subsets can be run separately).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import time
from pathlib import Path

import torch

from common import perplexities
from retrofitter.adapters import adapter_for
from retrofitter.api import compress, load_model, write_json
from retrofitter.config import CompressConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.accounting import account

_UNIFORM = dict(allocation="uniform")
_SEQUENTIAL = dict(statistics="compressed")  # the local methods default to one pass of teacher statistics
_LATENT = dict(method="latentllm", joint_qk=True, joint_mlp=True, joint_vo=False, mlp_algorithm="streaming",
               statistics="compressed", down_fit="ridge")
PARTS: dict[str, dict] = {
    "rootcov_plain": dict(method="asvd-rootcov", junction=False, **_SEQUENTIAL, **_UNIFORM),
    "rootcov": dict(method="asvd-rootcov", **_SEQUENTIAL, **_UNIFORM),
    "joint_qk": dict(_LATENT, joint_mlp=False, **_UNIFORM),
    "joint_ud": dict(_LATENT, **_UNIFORM),
    "joint_vo": dict(_LATENT, joint_vo=True, **_UNIFORM),
    "rootcov_global_fisher": dict(method="asvd-rootcov", **_SEQUENTIAL, allocation="global", allocation_weighting="fisher"),
    "latentllm_global_fisher": dict(_LATENT, allocation="global", allocation_weighting="fisher"),
    # which joint part costs at mild ratios: one joint part at a time under the same global plan
    "latentllm_global_fisher_joint_qk_only": dict(_LATENT, joint_mlp=False, allocation="global",
                                                  allocation_weighting="fisher"),
    "latentllm_global_fisher_joint_ud_only": dict(_LATENT, joint_qk=False, allocation="global",
                                                  allocation_weighting="fisher"),
    # the down fit of the joint MLP: damping anchored at W_d, and a per-layer held-out choice against local
    "latentllm_global_fisher_anchored": dict(_LATENT, down_fit="anchored", allocation="global",
                                             allocation_weighting="fisher"),
    "latentllm_global_fisher_select": dict(_LATENT, down_fit="select", allocation="global",
                                           allocation_weighting="fisher"),
    "latentllm_global_fisher_anchored_teacher_target": dict(_LATENT, down_fit="anchored", allocation="global",
                                                            allocation_weighting="fisher", statistics="teacher_target"),
    "rootcov_global": dict(method="asvd-rootcov", **_SEQUENTIAL, allocation="global", allocation_weighting="relative"),
    "latentllm_global": dict(_LATENT, allocation="global", allocation_weighting="relative"),
    "latentllm_global_fisher_kv50": dict(_LATENT, allocation="global", allocation_weighting="fisher", kv_ratio=0.5),
    "latentllm_global_fisher_anchored_kv50": dict(_LATENT, down_fit="anchored", allocation="global",
                                                  allocation_weighting="fisher", kv_ratio=0.5),
    "rootcov_refit": dict(method="asvd-rootcov", **_SEQUENTIAL, refit_within_layer=True, **_UNIFORM),
    # teacher-target correction (linalg/teacher_target.py): each fit reproduces the original model's outputs
    "rootcov_teacher_target": dict(method="asvd-rootcov", statistics="teacher_target", refit_within_layer=True,
                                   **_UNIFORM),
    "rootcov_global_fisher_teacher_target": dict(method="asvd-rootcov", allocation="global",
                                                 allocation_weighting="fisher", statistics="teacher_target"),
}
RESULTS = Path(__file__).parent / "results"


def run_one(args, label, settings, calibration, eval_blocks, extra="") -> dict:
    model, _ = load_model(args.model)
    base = account(model)
    start = time.perf_counter()
    config = CompressConfig.from_flat(dict(settings, batch_size=args.batch_size))  # flat: common + method options
    model, report = compress(model, config, calibration, progress=False)
    seconds = time.perf_counter() - start
    ppl = perplexities(model, eval_blocks, args.batch_size)
    acc = account(model)
    layers = report["layers"]
    down_name = adapter_for(model).linear_groups[-1][0]
    qk_errors = [r["qk_score_error"] for r in layers if "qk_score_error" in r]
    qk_local = [r["qk_score_error_local"] for r in layers if "qk_score_error_local" in r]
    row = {"part": label, "ratio": report["ratio"], "extra": extra, "ppl": ppl,
           "targets_reduction": report["targets_reduction"],
           "params_linear": acc.params_linear, "linear_reduction": 1 - acc.params_linear / base.params_linear,
           "kv_bytes_per_token": acc.kv_bytes_per_token, "compress_seconds": seconds,
           "mean_qk_score_error": sum(qk_errors) / len(qk_errors) if qk_errors else None,
           "mean_qk_score_error_local": sum(qk_local) / len(qk_local) if qk_local else None,
           "mean_proxy_error": sum(e["proxy_error"] for r in layers for e in r["matrices"].values())
           / max(1, sum(len(r["matrices"]) for r in layers)),
           "keep_fraction_by_projection": report["allocation"].get("keep_fraction_by_projection"),
           "ranks": {f"{r['layer']}.{n}": e["rank"] for r in layers for n, e in r["matrices"].items()},
           # per layer, the fit of the MLP's last projection (down_fit="select": joint or local by held-out error)
           "down_fits": [e["method"] for r in layers for n, e in r["matrices"].items() if n == down_name]}
    print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
    return row


def markdown(payload) -> str:
    corpora = payload["settings"]["eval"]
    head = ["part", "ratio", "extra", *[f"ppl {c}" for c in corpora], "linear red.", "KV B/token",
            "qk score err (local)", "compress s"]
    lines = [f"Eval: {payload['settings']['max_eval_tokens']} tokens per corpus, seq {payload['settings']['seq_len']}; "
             f"calibration {payload['settings']['calib_samples']}x{payload['settings']['seq_len']} wiki-calib.",
             f"Original: " + ", ".join(f"{c} {v:.2f}" for c, v in payload.get("original", {}).items()), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(payload["rows"], key=lambda r: (r["ratio"], r["part"], r["extra"])):
        qk = "-" if r["mean_qk_score_error"] is None else f"{r['mean_qk_score_error']:.4f}"
        if r.get("mean_qk_score_error_local") is not None:
            qk += f" ({r['mean_qk_score_error_local']:.4f})"
        lines.append("| " + " | ".join([r["part"], f"{r['ratio']:g}", r["extra"] or "-",
                                        *[f"{r['ppl'][c]:.2f}" for c in corpora], f"{r['linear_reduction']:.1%}",
                                        str(r["kv_bytes_per_token"]), qk, f"{r['compress_seconds']:.0f}"]) + " |")
    return "\n".join(lines)


def planned_runs(args) -> list[tuple[str, float]]:
    """(part, ratio) pairs: ``--only part@ratio,...`` or every ``--parts`` × ``--ratios``."""
    known = [*PARTS, "qk_sweep"]
    if args.only:
        runs = []
        for item in args.only.split(","):
            part, _, ratio = item.partition("@")
            if not ratio:
                raise SystemExit(f"--only items are part@ratio, got {item!r}")
            runs.append((part, float(ratio)))
    else:
        ratios = [float(r) for r in args.ratios.split(",")]
        parts = args.parts.split(",")
        runs = [(p, r) for r in ratios for p in parts if p != "qk_sweep"]
        runs += [("qk_sweep", ratios[0])] if "qk_sweep" in parts else []
    unknown = sorted({p for p, _ in runs if p not in known})
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; known: {known}")
    return runs


class ResultFile:
    """The ablation JSON + markdown; rows merged by (part, ratio, extra) under an exclusive file lock."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def update(self, change) -> dict:
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            payload = json.loads(self.path.read_text()) if self.path.exists() else {"rows": []}
            change(payload)
            write_json(payload, self.path)  # temp file + rename
            self.path.with_suffix(".md").write_text(markdown(payload) + "\n")
            return payload

    def record(self, row: dict) -> dict:
        key = (row["part"], row["ratio"], row["extra"])

        def change(payload):
            payload["rows"] = [r for r in payload["rows"] if (r["part"], r["ratio"], r["extra"]) != key] + [row]

        return self.update(change)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--parts", default=",".join([*PARTS, "qk_sweep"]))
    parser.add_argument("--only", default=None, help="explicit part@ratio list (overrides --parts/--ratios), "
                                                     "run in the order given")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval", default="wiki-eval,austen")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--qk-iterations", default="1,2,4,8")  # tucker2 needs >= 1; the sweep adds local rootcov
    parser.add_argument("--skip-original", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "compress_ablation.json"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = planned_runs(args)
    results = ResultFile(Path(args.out))
    model, tokenizer = load_model(args.model)
    calibration = token_blocks(tokenizer, load_text("wiki-calib"), args.seq_len, max_blocks=args.calib_samples)
    corpora = args.eval.split(",")
    eval_blocks = {c: token_blocks(tokenizer, load_text(c), args.seq_len, max_tokens=args.max_eval_tokens)
                   for c in corpora}
    settings = {"model": args.model, "calib_samples": int(calibration.shape[0]), "seq_len": args.seq_len,
                "eval": corpora, "max_eval_tokens": args.max_eval_tokens, "threads": torch.get_num_threads(),
                "date": datetime.datetime.now().isoformat(timespec="seconds")}

    def start(payload):
        old = payload.get("settings", {})
        if payload["rows"] and any(old.get(k) != settings[k] for k in ("model", "calib_samples", "seq_len",
                                                                          "max_eval_tokens")):
            raise SystemExit(f"{args.out} holds rows measured with other settings {old}; use another --out")
        payload["settings"] = settings

    payload = results.update(start)
    if not args.skip_original and "original" not in payload:
        original = perplexities(model, eval_blocks, args.batch_size)
        print("original", original, flush=True)
        results.update(lambda p: p.__setitem__("original", original))
    del model

    for part, ratio in runs:
        if part != "qk_sweep":
            payload = results.record(run_one(args, part, {"ratio": ratio, **PARTS[part]}, calibration, eval_blocks))
            continue
        for iterations in [int(i) for i in args.qk_iterations.split(",")]:
            settings_qk = {"ratio": ratio, **PARTS["joint_qk"], "targets": ("q", "k"), "qk_iterations": iterations}
            payload = results.record(run_one(args, "qk_sweep", settings_qk, calibration, eval_blocks,
                                             extra=f"qk_iter={iterations}"))
        payload = results.record(run_one(args, "qk_sweep", {"ratio": ratio, **PARTS["rootcov"], "targets": ("q", "k")},
                                         calibration, eval_blocks, extra="local rootcov q,k"))
    print(markdown(payload))


if __name__ == "__main__":
    main()
