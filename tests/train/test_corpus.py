"""The corpus: deterministic file order, a stable held-out split, skipped files named."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.train.corpus import is_held_out, list_source_files, load_corpus


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    for i in range(40):
        _write(tmp_path, f"pkg{i % 4}/mod_{i:02d}.py", f"x = {i}\n".encode())
    _write(tmp_path, "site-packages/third.py", b"third = 1\n")
    _write(tmp_path, "pkg0/__pycache__/cached.py", b"cached = 1\n")
    _write(tmp_path, "bad_coding.py", b"s = '\xff\xfe'\n")
    _write(tmp_path, "empty.py", b"   \n")
    _write(tmp_path, "notes.txt", b"not python\n")
    return tmp_path


def test_held_out_membership_is_a_function_of_the_path_only() -> None:
    paths = [f"lib/module_{i}.py" for i in range(4000)]
    first = [is_held_out(p, 0.1) for p in paths]
    second = [is_held_out(p, 0.1) for p in reversed(paths)][::-1]
    assert first == second
    # A hash split: close to the asked fraction, and nested (a larger fraction keeps every smaller one's files).
    assert 0.08 < sum(first) / len(paths) < 0.12
    assert all(is_held_out(p, 0.3) for p, held in zip(paths, first, strict=True) if held)


def test_listing_is_sorted_and_skips_third_party_and_caches(tree: Path) -> None:
    rels = [p.relative_to(tree).as_posix() for p in list_source_files(tree)]
    assert rels == sorted(rels)
    assert "site-packages/third.py" not in rels
    assert not any("__pycache__" in r for r in rels)
    assert "notes.txt" not in rels
    assert len(rels) == 42  # 40 modules + bad_coding.py + empty.py


def test_load_corpus_splits_and_reports(tree: Path) -> None:
    corpus = load_corpus(tree, held_out_fraction=0.25)
    names = [f.path for f in corpus.train] + [f.path for f in corpus.held_out]
    assert sorted(names) == sorted(f"pkg{i % 4}/mod_{i:02d}.py" for i in range(40))
    assert {f.path for f in corpus.held_out} == {n for n in names if is_held_out(n, 0.25)}
    assert corpus.skipped_undecodable == ("bad_coding.py",)
    assert corpus.python_version is None  # an explicit root is not this interpreter's stdlib
    summary = corpus.describe()
    assert summary["train_files"] + summary["held_out_files"] == 40
    assert summary["train_bytes"] == sum(len(f.text) for f in corpus.train)


def test_load_corpus_max_files_keeps_path_order(tree: Path) -> None:
    corpus = load_corpus(tree, held_out_fraction=0.5, max_files=12)
    kept = sorted([f.path for f in corpus.train] + [f.path for f in corpus.held_out])
    listed = [p.relative_to(tree).as_posix() for p in list_source_files(tree)][:12]
    assert kept == sorted(r for r in listed if r not in ("bad_coding.py", "empty.py"))


def test_load_corpus_rejects_bad_settings(tree: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="held_out_fraction"):
        load_corpus(tree, held_out_fraction=1.5)
    with pytest.raises(ConfigError, match="not a directory"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ConfigError, match="both must be non-empty"):
        load_corpus(tree, held_out_fraction=1e-9)


def test_default_root_is_this_interpreters_stdlib() -> None:
    corpus = load_corpus(max_files=60, held_out_fraction=0.2)
    assert corpus.python_version is not None
    assert any(f.path.endswith(".py") for f in corpus.train)
