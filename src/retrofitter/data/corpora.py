"""Text corpora by name: built-ins (fetched on first use), local files/directories, HF datasets.

Accepted forms for :func:`load_text`:

* a built-in name from :data:`CORPORA` — ``wiki-calib``, ``wiki-eval``, ``austen``
* a path to a text file, or to a directory whose ``*.txt`` files (recursive, sorted by relative
  path) are concatenated with a blank line between files
* ``hf:<dataset>[:<config>][:<split>]`` — ``datasets.load_dataset(dataset, config, split=split)``,
  column ``text``, rows joined by a blank line (default split ``train``; e.g.
  ``hf:wikitext:wikitext-2-raw-v1:test``). Needs the optional ``datasets`` package and a hub.
* several of these joined by commas (``wiki-calib,samples.txt``): their texts in that order, a blank line
  between them (a name that is itself an existing path is read as one corpus)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cache import corpora_dir

HF_PREFIX = "hf:"
HF_DEFAULT_SPLIT = "train"
HF_TEXT_COLUMN = "text"
FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class BuiltinCorpus:
    """A corpus produced by a fetch group (see :mod:`retrofitter.data.fetch`)."""

    fetch_group: str
    filename: str
    description: str


CORPORA: dict[str, BuiltinCorpus] = {
    "wiki-calib": BuiltinCorpus("wiki", "wiki-calib.txt", "English Wikipedia prose, ~80% of the articles (calibration)"),
    "wiki-eval": BuiltinCorpus("wiki", "wiki-eval.txt", "English Wikipedia prose, the other ~20% (evaluation)"),
    "austen": BuiltinCorpus("austen", "austen.txt", "Jane Austen's six novels (evaluation, second domain)"),
}


def _accepted_forms() -> str:
    return (f"a built-in corpus ({', '.join(sorted(CORPORA))}), a path to a text file or a directory of .txt "
            f"files, or {HF_PREFIX}<dataset>[:<config>][:<split>] (several joined by commas)")


def builtin_corpus_path(name: str, progress: bool = True) -> Path:
    """Path of a built-in corpus file, fetching its group first if needed."""
    from .fetch import fetch

    if name not in CORPORA:
        raise ValueError(f"{name!r} is not a built-in corpus; built-ins: {sorted(CORPORA)}")
    corpus = CORPORA[name]
    fetch([corpus.fetch_group], progress=progress)
    return corpora_dir() / corpus.filename


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:<dataset>[:<config>][:<split>]`` → (dataset, config or None, split)."""
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"bad HF corpus spec {spec!r}; expected {HF_PREFIX}<dataset>[:<config>][:<split>]")
    dataset = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else HF_DEFAULT_SPLIT
    return dataset, config, split


def _load_hf_text(spec: str) -> str:
    dataset_name, config, split = parse_hf_spec(spec)
    try:
        import datasets  # optional: only needed for hf: corpora
    except ImportError as error:
        raise ImportError(f"corpus {spec!r} needs the HF datasets package: pip install datasets") from error
    dataset = datasets.load_dataset(dataset_name, config, split=split)
    if HF_TEXT_COLUMN not in dataset.column_names:
        raise ValueError(f"dataset {spec!r} has no {HF_TEXT_COLUMN!r} column; columns: {dataset.column_names}")
    return FILE_SEPARATOR.join(dataset[HF_TEXT_COLUMN])


def _load_local_text(path: Path) -> str:
    if path.is_file():
        return read_text_file(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is neither a regular file nor a directory")
    files = sorted(path.rglob("*.txt"), key=lambda file: file.relative_to(path).as_posix())
    if not files:
        raise ValueError(f"directory {str(path)!r} contains no .txt files")
    return FILE_SEPARATOR.join(read_text_file(file).strip("\n") for file in files)


def read_text_file(path: Path) -> str:
    """The UTF-8 text of ``path``; ``ValueError`` naming the file when it is empty, binary or not UTF-8."""
    data = Path(path).read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{str(path)!r} is a binary file (NUL byte at offset {nul}), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{str(path)!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
                         f"convert it, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise ValueError(f"{str(path)!r} is empty (no text to read)")
    return text


def corpus_parts(name: str | Path) -> list[str | Path]:
    """The corpora of a comma-joined ``name`` in order (one part when it has no comma or is an existing path)."""
    if not isinstance(name, str) or "," not in name or Path(name).expanduser().exists():
        return [name]
    parts = [part.strip() for part in name.split(",")]
    if not all(parts):
        raise ValueError(f"corpus list {name!r} has an empty entry; expected names joined by single commas")
    return parts


def check_corpus(name: str | Path, flag: str = "corpus") -> None:
    """Raise ``ValueError`` (naming ``flag`` and the file) unless ``name`` is an accepted corpus form (or a comma
    list of them); a local file or directory is read once and must be non-empty UTF-8 text. Built-in and ``hf:``
    corpora are not loaded."""
    try:
        parts = corpus_parts(name)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    if len(parts) > 1:
        for part in parts:
            check_corpus(part, flag)
        return
    if isinstance(name, str) and (name in CORPORA or name.startswith(HF_PREFIX)):
        return
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"{flag} {str(name)!r}: no such corpus; expected {_accepted_forms()}")
    try:
        _load_local_text(path)
    except (ValueError, OSError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        reason = reason.removeprefix(f"{str(path)!r} ")  # the corpus itself: named once, by the flag
        raise ValueError(f"{flag} {str(name)!r}: {reason}") from None


def load_text(name: str | Path, progress: bool = True) -> str:
    """The text of a corpus given in any of the accepted forms (see the module docstring)."""
    parts = corpus_parts(name)
    if len(parts) > 1:
        return FILE_SEPARATOR.join(load_text(part, progress=progress).strip("\n") for part in parts)
    if isinstance(name, str) and name in CORPORA:
        return builtin_corpus_path(name, progress=progress).read_text(encoding="utf-8")
    if isinstance(name, str) and name.startswith(HF_PREFIX):
        return _load_hf_text(name)
    path = Path(name).expanduser()
    if path.exists():
        return _load_local_text(path)
    raise ValueError(f"unknown corpus {str(name)!r}: expected {_accepted_forms()}")
