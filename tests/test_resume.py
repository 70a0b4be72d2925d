"""Checkpoints on real MPI processes.

A 4-rank run killed at step 10 and resumed from its per-rank checkpoints continues exactly as
an uninterrupted run (parameters, optimizer state, PushSum weight and iteration restored).

Horovod's recipe (rank 0 saves; a second launch, or a rebuilt optimizer, loads on rank 0 and
broadcasts), in every SGP mode and every layout: horovod_resume_checks.py.
"""
import json

import pytest
import torch

from mpi_launch import run_mpi


def test_kill_and_resume_equals_uninterrupted(tmp_path):
    run_mpi(4, "resume_checks.py", "full", str(tmp_path))
    crashed = run_mpi(4, "resume_checks.py", "crash", str(tmp_path), check=False, timeout=120)
    assert crashed.returncode != 0
    run_mpi(4, "resume_checks.py", "resume", str(tmp_path))
    for rank in range(4):
        full = torch.load(tmp_path / f"full_{rank}.pt")
        resumed = torch.load(tmp_path / f"resumed_{rank}.pt")
        assert torch.allclose(full, resumed, atol=1e-6, rtol=0), (rank, (full - resumed).abs().max())
    weights = torch.load(tmp_path / "ckpt_1.pt")["optimizer"]["hvd_sgp"]["weights"]
    assert weights[0] != 1.0  # the random graph is not doubly stochastic: the weight mattered


# HVD_SGP_LOCAL_SIZE: every rank its own node, the machine one node, nodes of two ranks
LAYOUTS = {"own-nodes": ("1", 2), "one-node": ("", 2), "two-rank-nodes": ("2", 4)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_horovod_rank0_checkpoint_recipe(tmp_path, layout):
    """Launch 1 saves rank 0's checkpoint in every mode; launch 2 resumes from it with
    Horovod's recipe. The checks within one launch (rebuilt optimizers mid-run, plain torch
    checkpoints and LR schedulers, ranks that are out of step) run in launch 1, after the
    save."""
    local, n = LAYOUTS[layout]
    outputs = {}
    for phases in (("save", "inline"), ("resume",)):
        out = run_mpi(n, "world_checks.py",
                      *(f"horovod_resume_checks.py {phase} {tmp_path}" for phase in phases),
                      env={"HVD_SGP_LOCAL_SIZE": local}, timeout=600).stdout
        for phase in phases:
            assert f"all resume {phase} checks passed on {n} ranks" in out, out
            outputs[phase] = out
    exact = outputs["resume"].count("the resumed run equals the uninterrupted one")
    assert exact == (10 if layout == "one-node" else 1), outputs["resume"]


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf_keras"])
@pytest.mark.parametrize("layout", ["own-nodes", "one-node"])
def test_keras_load_model_resume(tmp_path, layout, legacy):
    """keras_imagenet_resnet50.py's resume: epoch 1, rank 0's checkpoint; the second launch
    loads it on rank 0 with hvd.load_model, the others build afresh, fit from initial_epoch
    with BroadcastGlobalVariablesCallback (the others build their optimizers at train begin,
    so root's saved step count reaches them before the first step). SGP's iteration resumes
    from the saved optimizer's: a schedule switching at step 12 switches there, in the second
    epoch, as in the uninterrupted run. The uninterrupted run and the first epoch share
    the first launch (the uninterrupted one first, in fresh processes)."""
    local, n = LAYOUTS[layout]
    env = {"HVD_SGP_LOCAL_SIZE": local, "TF_USE_LEGACY_KERAS": legacy, "HVD_SGP_TIMEOUT": "120",
           "HVD_SGP_SCHEDULE": "0:sgp,12s:allreduce"}
    for phases in (("full", "first"), ("resume",)):
        out = run_mpi(n, "world_checks.py",
                      *(f"keras_resume_checks.py {phase} {tmp_path}" for phase in phases),
                      env=env, timeout=600).stdout
        for phase in phases:
            assert f"all keras resume {phase} checks passed on {n} ranks" in out, out
    assert ("resume: resumed from epoch 1, trained 1 epoch(s); optimizer at step 16, "
            "SGP at iteration 16") in out, out
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert [tuple(s) for s in resumed] == [tuple(s) for s in full[8:]], (resumed, full)
    assert [s[2] for s in resumed] == ["sgp"] * 4 + ["allreduce"] * 4, resumed
