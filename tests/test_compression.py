"""Communication-reduced SGP on real MPI processes (see compression_checks.py): compressed
PushSum keeps the average and trains, bytes shrink as the codecs say, the simulator agrees with
MPI, bad input fails at construction, local steps and SlowMo, exact resume; Keras too; and the
measurement script end to end in its --quick configuration."""
import json
import subprocess
import sys

import pytest

from mpi_launch import REPO, SharedChecks


TORCH = SharedChecks("compression_checks.py", worlds=[1, 3, 4])  # every check but Keras's
KERAS = SharedChecks("compression_checks.py", "check_keras", worlds=[2], needs="tensorflow")
TWO_RANK_NODES = SharedChecks("compression_checks.py", "check_pure_mixing_conserves_the_average",
                              "check_compressed_training_converges",
                              "check_slowmo_and_checkpoints", worlds=[4], local_size="2")


@pytest.mark.parametrize("n", [1, 3, 4])
def test_compression_checks(n):
    out = TORCH.run(n)
    print(out)
    assert f"all compression checks passed on {n} ranks" in out
    if n > 1:
        assert "keeps the average" in out and "less" in out


def test_two_rank_nodes_carry_compressed_shards():
    """HVD_SGP_LOCAL_SIZE=2 on 4 ranks: each local rank gossips its shard compressed."""
    out = TWO_RANK_NODES.run(4)
    assert "all compression checks passed on 4 ranks" in out


def test_keras():
    pytest.importorskip("tensorflow")
    out = KERAS.run(2, timeout=600)
    assert "Keras fit trains with top-k" in out and "all compression checks passed" in out


def test_benchmark_quick(tmp_path):
    out = tmp_path / "compression.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "compression_benchmark.py"), "--quick",
         "--out", str(out), "--markdown", str(tmp_path / "compression.md"), "--plots",
         str(tmp_path), "--logs", str(tmp_path / "logs"), "--cost-parameters", "100000"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["name"], r["overlap"]): r for r in report["rows"]}
    assert set(rows) == {("fp32", False), ("topk1", False), ("local4", False), ("topk1", True)}
    assert rows["topk1", False]["bytes_vs_fp32"] > 10
    local = rows["local4", False]  # no gossip: an allreduce every 4 steps, estimated
    assert local["allreduce_estimate"] and local["bytes_per_step"] == local["model_bytes"] / 4
    assert all(r["curve"] for r in rows.values())
    # at n = 2 exact SGP averages exactly every step (elastic constant 0); the others lag
    assert all(r["elastic"] > 0 for key, r in rows.items() if key != ("fp32", False))
    text = (tmp_path / "compression.md").read_text()
    assert "| top-k 1% |" in text and "| int8 |" in text  # the variant and codec-cost tables
    for png in ("compression_accuracy.png", "compression_elastic.png"):
        assert (tmp_path / png).stat().st_size > 10_000
