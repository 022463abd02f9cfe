"""Write a calibration text: the first N blocks of one corpus, then the whole of another (a sampled file).

`--calib A,B` reads all of A before B; to calibrate on N blocks of A followed by B's, write this file first.
A block holds seq_len − 1 text tokens (the BOS is prepended when blocks are cut), so the first N blocks' text is
the first N · (seq_len − 1) tokens, decoded; re-tokenizing the decoded text may shift a block's edge by a token.

    python benchmarks/calibration_mix.py --first wiki-calib --blocks 128 --then runs/samples.txt --out mix.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

from retrofitter.api import load_tokenizer
from retrofitter.data.blocks import tokenize_text
from retrofitter.data.cache import atomic_write_text
from retrofitter.data.corpora import load_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", default="wiki-calib", help="corpus whose first blocks come first")
    parser.add_argument("--blocks", type=int, required=True, help="blocks of --first to keep")
    parser.add_argument("--then", required=True, help="corpus appended whole (e.g. a retrofitter sample file)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer cuts the blocks")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        raise SystemExit(f"{args.out} exists")
    tokenizer = load_tokenizer(args.model)
    ids = tokenize_text(tokenizer, load_text(args.first))
    wanted = args.blocks * (args.seq_len - 1)
    if len(ids) < wanted:
        raise SystemExit(f"{args.first} holds {len(ids)} tokens, fewer than {args.blocks} blocks of {args.seq_len}")
    atomic_write_text(args.out, tokenizer.decode(ids[:wanted]) + "\n\n" + load_text(args.then))
    print(f"wrote {args.out}: {args.blocks} blocks of {args.first}, then {args.then}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
