"""The examples' cached digits (examples/digits_data.py) are scikit-learn's split, bit for bit,
whether computed, read from the cache, or computed again over a broken or unwritable cache."""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import digits_data  # noqa: E402


def scikit_learn(seed: int, stratify: bool) -> list:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=seed,
                            stratify=digits.target if stratify else None)


def same(got, expected) -> bool:
    return len(got) == len(expected) == 4 and all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("seed, stratify", [(0, False), (0, True), (3, False)])
def test_computed_then_cached_split_is_scikit_learns(tmp_path, monkeypatch, seed, stratify):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = scikit_learn(seed, stratify)
    first = digits_data.split(0.25, seed=seed, stratify=stratify)
    assert [a.dtype for a in first] == [np.float32, np.float32, np.int64, np.int64]
    assert same(first, expected)
    cached = list((tmp_path / "hvd_sgp").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".npz"
    monkeypatch.setattr(digits_data, "_compute", None)  # read from the cache, not computed
    assert same(digits_data.split(0.25, seed=seed, stratify=stratify), expected)


def test_a_broken_cache_is_computed_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = scikit_learn(0, False)
    digits_data.split(0.25, seed=0)
    [path] = (tmp_path / "hvd_sgp").iterdir()
    path.write_bytes(path.read_bytes()[:100])  # a file cut short
    assert same(digits_data.split(0.25, seed=0), expected)
    assert [p.name for p in (tmp_path / "hvd_sgp").iterdir()] == [path.name]  # no leftovers
    assert same(digits_data.split(0.25, seed=0), expected)


def test_an_unwritable_cache_still_gives_the_split(tmp_path, monkeypatch):
    (tmp_path / "hvd_sgp").write_text("a file where the cache's folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert same(digits_data.split(0.25, seed=0), scikit_learn(0, False))


def test_the_torch_examples_get_the_tensors_they_built_before(tmp_path, monkeypatch):
    """pytorch_digits.py, elastic_digits.py and bench_model.py built float32 tensors from
    scikit-learn's float64 images and split the tensors: the same bits, so the same runs."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    before = train_test_split(x, y, test_size=0.25, random_state=0)
    for attempt in ("computed", "cached"):
        now = list(map(torch.from_numpy, digits_data.split(0.25, seed=0)))
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(now, before)), attempt
