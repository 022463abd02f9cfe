"""``retrofitter sample``: its flags (from ``SampleConfig``) and the command (jobs/sample.py)."""

from __future__ import annotations

from ..config import SampleConfig
from .common import add_common
from .flags import add_config_flags, config_from_args

__all__ = ["add_sample_command", "cmd_sample"]


def add_sample_command(commands) -> None:
    sample = commands.add_parser("sample", help="a text file the original model writes, continuing prompts spread "
                                 "over a corpus: calibration text beyond a corpus's end (--calib FILE)")
    sample.add_argument("model", help="the model that writes (the original a conversion learns from)")
    add_config_flags(sample, SampleConfig)
    sample.add_argument("--prompts", default="wiki-calib", help="corpus the prompts are cut from (default wiki-calib)")
    sample.add_argument("--out", required=True, help="the text file to write (resumes a run stopped with the same "
                                                      "settings)")
    sample.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_common(sample)


def cmd_sample(args) -> int:
    from ..api import write_json
    from ..jobs import sample_job

    report = sample_job(args.model, args.out, config_from_args(SampleConfig, args), prompts=args.prompts,
                        overwrite=args.overwrite, dtype=args.dtype, device=args.device, progress=not args.quiet)
    resumed = f" (resumed after {report['resumed_from']})" if report["resumed_from"] else ""
    print(f"wrote {report['out']}: {report['samples']} texts of {report['tokens'] // report['samples']} tokens "
          f"(prompt + sampled), {report['seconds']} s{resumed}")
    if args.json:
        write_json(report, args.json)
    return 0
