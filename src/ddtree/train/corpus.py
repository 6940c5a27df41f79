"""The demo pair's corpus: the Python source files of the running interpreter's standard library.

Why the stdlib: it is on every machine that runs ddtree (so training needs no download), it is real code of one
consistent style, and it is large enough (about 30 MB, ~10 M tokens) for an 8 M-parameter model to learn to write
plausible Python. The corpus therefore depends on the interpreter: the shipped pair was trained on the H200's
Python 3.12 stdlib; a CPU smoke run uses whichever Python runs it (its version is recorded in every log).

Files are listed in a deterministic order (sorted relative POSIX paths). The held-out split is chosen by a stable
hash of the relative path, so the same file is held out on every machine and Python version, and held-out files
are never seen by the tokenizer, the target or the drafter.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ddtree.errors import ConfigError

# Third-party packages live under these folders of some stdlib layouts; they are not the standard library.
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    """One corpus document: its path relative to the stdlib root (POSIX form) and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The train and held-out documents, plus where they came from."""

    root: str
    python_version: str | None  # the running interpreter's, when the corpus is its own stdlib
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]
    skipped_undecodable: tuple[str, ...]

    def describe(self) -> dict[str, object]:
        """A JSON-able summary for logs and model cards."""
        return {
            "root": self.root,
            "python_version": self.python_version,
            "train_files": len(self.train),
            "held_out_files": len(self.held_out),
            "train_bytes": sum(len(f.text.encode("utf-8")) for f in self.train),
            "held_out_bytes": sum(len(f.text.encode("utf-8")) for f in self.held_out),
            "skipped_undecodable": list(self.skipped_undecodable),
        }


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, fraction: float) -> bool:
    """Whether ``relative_path`` belongs to the held-out split.

    The first 8 bytes of the path's SHA-256, read as an integer in [0, 2**64), are compared with
    ``fraction * 2**64``: stable across machines and runs (unlike Python's salted ``hash``)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def list_source_files(root: Path) -> list[Path]:
    """All ``*.py`` files under ``root`` outside third-party folders, sorted by relative POSIX path."""
    files = [p for p in root.rglob("*.py") if p.is_file() and not _EXCLUDED_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(
    root: Path | None = None, *, held_out_fraction: float = 0.04, max_files: int | None = None
) -> Corpus:
    """Read the corpus and split it.

    ``max_files`` keeps only the first files in path order (smoke runs); files that are not valid UTF-8 (a few
    deliberately broken test inputs) are skipped and listed."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    if max_files is not None and max_files < 2:
        raise ConfigError(f"max_files must be at least 2 (one train, one held-out), got {max_files!r}")
    own_stdlib = root is None
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ConfigError(f"corpus root {str(root)!r} is not a directory; pass the stdlib folder or omit it")
    train: list[SourceFile] = []
    held_out: list[SourceFile] = []
    skipped: list[str] = []
    paths = list_source_files(root)
    if max_files is not None:
        paths = paths[:max_files]
    for path in paths:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text.strip():
            continue
        (held_out if is_held_out(rel, held_out_fraction) else train).append(SourceFile(rel, text))
    if not train or not held_out:
        raise ConfigError(
            f"corpus under {str(root)!r} split into {len(train)} train and {len(held_out)} held-out files; "
            "both must be non-empty: use more files (max_files) or another held_out_fraction"
        )
    return Corpus(
        root=str(root),
        python_version=platform.python_version() if own_stdlib else None,
        train=tuple(train),
        held_out=tuple(held_out),
        skipped_undecodable=tuple(skipped),
    )
