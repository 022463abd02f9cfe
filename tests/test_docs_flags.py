"""The option pages name every flag of their command (docs/compress.md, mla.md — mla and sample —, export.md, recall.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrofitter.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
# flags every command shares, documented once in the README's CLI section
SHARED = {"--help", "--json", "--dtype", "--device", "--quiet", "--eval", "--eval-seq-len", "--max-eval-tokens",
          "--eval-batch-size", "--out", "--overwrite", "--no-eval"}


def _flags(command: str) -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {o for a in commands.choices[command]._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize("command, page, shared", [("compress", "compress.md", set()), ("mla", "mla.md", SHARED),
                                                   ("export", "export.md", {"--help", "--quiet"}),
                                                   ("recall", "recall.md", SHARED),
                                                   ("sample", "mla.md", SHARED)])
def test_every_flag_is_on_its_page(command, page, shared):
    text = (DOCS / page).read_text()
    missing = sorted(f for f in _flags(command) - shared - {"--help"} if f"`{f}" not in text)
    assert not missing, f"docs/{page} does not name {missing}"
