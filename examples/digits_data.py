"""scikit-learn's digits, split into train and test: computed once on a machine, then read
from a cache.

Why: importing scikit-learn costs a process 0.8-1.8 s of CPU. Every rank of a job paid it,
and a replacement spawned by a repair paid it while the survivors waited for it at
``state.sync()``. The split is scikit-learn's own (``load_digits`` and ``train_test_split``),
saved as .npz under ``$XDG_CACHE_HOME/hvd_sgp`` (``~/.cache/hvd_sgp``), one file per
(test size, seed, stratified or not). The first process to need one computes it; processes
that start together may each compute it, and each renames a whole file into place, so no
reader sees a partial one. A cache that cannot be read is computed again.
"""
from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_KEYS = ("x_train", "x_test", "y_train", "y_test")


def split(test_size: float = 0.25, seed: int = 0, stratify: bool = False) -> Split:
    """(x_train, x_test, y_train, y_test): the 8x8 images as 64 float32 features in [0, 1],
    the labels as int64; ``train_test_split(x, y, test_size, random_state=seed)``, stratified
    by label when ``stratify``."""
    kind = "stratified" if stratify else "shuffled"
    path = cache_dir() / f"digits-{test_size}-{seed}-{kind}.npz"
    try:
        with np.load(path) as saved:
            return tuple(saved[key] for key in _KEYS)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass
    arrays = _compute(test_size, seed, stratify)
    _save(path, arrays)
    return arrays


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvd_sgp"


def _compute(test_size: float, seed: int, stratify: bool) -> Split:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return tuple(train_test_split(x, y, test_size=test_size, random_state=seed,
                                  stratify=y if stratify else None))


def _save(path: Path, arrays: Split) -> None:
    """Write to a file of this process's own, then rename it into place; a cache that cannot
    be written is left out (the next process computes the split again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, written = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **dict(zip(_KEYS, arrays)))
        os.replace(written, path)
    except OSError:
        Path(written).unlink(missing_ok=True)
