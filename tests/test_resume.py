"""A 4-rank run killed at step 10 and resumed from its per-rank checkpoints continues exactly as
an uninterrupted run (parameters, optimizer state, PushSum weight and iteration restored)."""
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
