"""scripts/horovod_suite.py on a stand-in for Horovod's test file: real 2-rank launches whose
tests pass, fail, skip, crash a rank or hang one; a hang costs its batch and one re-run, and
the tree the tests are read from is left untouched."""
import os
import subprocess
import sys
import textwrap

SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                     "horovod_suite.py")
STAND_IN = textwrap.dedent("""
    import os
    import time
    import unittest

    import horovod

    RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])


    class TorchTests(unittest.TestCase):
        def test_a_passes(self):
            # The alias package finds Horovod's own helpers in the peer tree.
            from horovod.runner.util.threads import marker
            assert marker == "peer"

        def test_b_fails_everywhere(self):
            assert False, "wrong on every rank"

        def test_c_skips(self):
            self.skipTest("No GPUs available")

        def test_d_crashes_rank_0(self):
            if RANK == 0:
                os._exit(3)

        def test_e_passes_after_the_crash(self):
            pass

        def test_f_hangs_on_rank_1(self):
            if RANK == 1:
                time.sleep(600)

        def test_g_passes_after_the_hang(self):
            pass

        def test_h_fails_once_on_rank_1(self):
            # Fails the first time rank 1 runs it (as a timing test may in a loaded batch).
            if RANK == 1 and not os.path.exists("h_failed_once"):
                open("h_failed_once", "w").close()
                assert False, "rank 1 lagged"
""")


def test_batches_hangs_crashes_and_reruns(tmp_path):
    peer = tmp_path / "peer"
    tests = peer / "horovod" / "test" / "parallel"
    tests.mkdir(parents=True)
    (tests / "test_torch.py").write_text(STAND_IN)
    helpers = peer / "horovod" / "horovod" / "runner" / "util"
    helpers.mkdir(parents=True)
    (helpers / "threads.py").write_text("marker = 'peer'\n")
    out, results = tmp_path / "out", tmp_path / "results.tsv"
    run = subprocess.run([sys.executable, SUITE, "--peer", str(peer), "--layout", "default",
                          "--batch", "8", "--limit", "20", "--out", str(out),
                          "--results", str(results), "--min-passed", "default=3"],
                         capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    verdicts = dict(line.split()[:2][::-1] for line in lines if line.split()[:1] in (
        ["PASS"], ["FAIL"], ["SKIP"], ["HANG"]))
    assert verdicts == {"test_a_passes": "PASS", "test_b_fails_everywhere": "FAIL",
                        "test_c_skips": "SKIP", "test_d_crashes_rank_0": "FAIL",
                        "test_e_passes_after_the_crash": "PASS",
                        "test_f_hangs_on_rank_1": "HANG",
                        "test_g_passes_after_the_hang": "PASS",
                        "test_h_fails_once_on_rank_1": "PASS"}, run.stdout + run.stderr
    assert "wrong on every rank" in next(l for l in lines if "test_b_" in l)
    assert "PASS 4, FAIL 2, SKIP 1, HANG 1 of 8 tests" in run.stdout
    assert run.returncode == 1  # a hang fails the run
    assert "layout default FAILS the bar: new hang(s) ['test_f_hangs_on_rank_1']" in run.stdout
    # b failed alike on every rank: its verdict holds. d's crash ended the first batch, maybe
    # before d ended on rank 1: d runs again alone, e to h in a fresh batch. There f hangs on
    # rank 1 after every earlier test ended in step: its HANG holds (the hang cost that batch
    # only), and g and h, which rank 1 never reached, go into a third batch, where h fails on
    # rank 1 only: run alone, it passes, and that verdict counts.
    launches = sorted(p.name for p in out.glob("*.log"))
    assert launches == ["default.batch0.log", "default.batch1.log", "default.batch2.log",
                        "default.test_d_crashes_rank_0.log",
                        "default.test_h_fails_once_on_rank_1.log"]
    assert len(results.read_text().splitlines()) == 1 + 1 + 8
    assert not list(peer.rglob("__pycache__"))  # nothing written into the peer tree
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert leftover.stdout == ""  # every rank of the stopped launches is gone


def test_a_spent_budget_leaves_tests_not_run(tmp_path):
    peer = tmp_path / "peer"
    tests = peer / "horovod" / "test" / "parallel"
    tests.mkdir(parents=True)
    (tests / "test_torch.py").write_text(STAND_IN)
    run = subprocess.run([sys.executable, SUITE, "--peer", str(peer), "--layout", "both",
                          "--budget", "0", "--out", str(tmp_path / "out"),
                          "--min-passed", "default=8,gossip=8"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr  # nothing hung; floors not checked
    assert run.stdout.count("NOT RUN test_") == 16
    assert "PASS 0, FAIL 0, SKIP 0, HANG 0, NOT RUN 8 of 8 tests" in run.stdout
    assert not list((tmp_path / "out").glob("*.log"))  # no launch started


def test_a_known_hang_is_reported_without_failing(tmp_path):
    peer = tmp_path / "peer"
    tests = peer / "horovod" / "test" / "parallel"
    tests.mkdir(parents=True)
    (tests / "test_torch.py").write_text(STAND_IN)
    run = subprocess.run([sys.executable, SUITE, "--peer", str(peer), "--layout", "gossip",
                          "-k", "test_f_", "--limit", "15", "--out", str(tmp_path / "out"),
                          "--known-hangs", "test_f_hangs_on_rank_1,test_not_there"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "HANG test_f_hangs_on_rank_1" in run.stdout
    assert "layout gossip: known hang(s) ['test_f_hangs_on_rank_1']" in run.stdout
