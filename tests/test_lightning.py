"""hvd_sgp.lightning.SGPStrategy: Lightning's Trainer on real MPI ranks (the digits MLP), in
both layouts (every rank its own SGP node, and one node of all ranks), SGP and AllReduce:
metrics reduced, samplers distributed, ModelCheckpoint saves and a second launch resumes from
it, SGP figures in the logger."""
import importlib.util

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="lightning is not installed (pip install "
                                       "hvd_sgp[lightning])")


def launch(phase: str, directory, mode: str, local_size: str) -> str:
    out = run_mpi(2, "lightning_checks.py", phase, str(directory), mode,
                  env={"HVD_SGP_LOCAL_SIZE": local_size}, timeout=400).stdout
    assert out.count(f"lightning {phase} {mode} passed") == 2, out[-3000:]
    return out


@pytest.mark.parametrize("local_size", ["1", ""], ids=["gossip", "one-node"])
def test_sgp_strategy_fits_checkpoints_and_resumes(tmp_path, local_size):
    launch("fit", tmp_path, "sgp", local_size)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    launch("resume", tmp_path, "sgp", local_size)


def test_sgp_strategy_allreduce_mode(tmp_path):
    launch("fit", tmp_path, "allreduce", "1")
