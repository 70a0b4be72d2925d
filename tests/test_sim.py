"""The in-process simulator: exact averaging at n = 1024, step-by-step agreement with the MPI
path, the CLI end to end, and Overlap SGP's delays (mass conservation, the de-bias ablation)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.pushsum import Audit
from hvd_sgp.common.topology import CustomGraph
from hvd_sgp.sim import SimNetwork, make_objective, simulate
from hvd_sgp.sim.__main__ import main
from mpi_launch import REPO, run_mpi


def test_exponential_graph_averages_exactly_at_1024_nodes():
    net = SimNetwork("exponential", 16, n=1024)
    net.params[...] = np.random.default_rng(0).normal(size=net.params.shape)
    average = net.params.mean(axis=0)
    for _ in range(10):
        net.step()
    assert np.abs(net.params - average).max() <= 1e-12
    assert net.weights().min() == 1.0  # doubly stochastic: the weight stays 1


def test_simulates_without_loading_mpi():
    """The simulator and telemetry import, and a compressed, delayed run mixes, without
    loading mpi4py.MPI: the mixers take their transport and shard from outside."""
    code = ("import sys, hvd_sgp.sim, hvd_sgp.common.telemetry; "
            "assert 'mpi4py.MPI' not in sys.modules, 'imported'; "
            "hvd_sgp.sim.simulate(nodes=8, steps=3, codec='int8'); "
            "hvd_sgp.sim.simulate(nodes=8, steps=3, delay=2, codec='randomk:0.5'); "
            "assert 'mpi4py.MPI' not in sys.modules, 'simulated'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "ok", out.stderr


def test_agrees_with_mpi_step_by_step():
    out = run_mpi(8, "sim_checks.py", timeout=180).stdout
    assert "simulator agrees with MPI on 8 ranks over 12 steps" in out, out


def test_cli_end_to_end(tmp_path, capsys):
    records, plot = tmp_path / "records.json", tmp_path / "plot.png"
    run = subprocess.run(
        [sys.executable, "-m", "hvd_sgp.sim", "--nodes", "8", "--steps", "4", "--topology",
         "exponential,ring", "--topology", "random", "--delay", "1", "--objective", "logistic",
         "--json", str(records), "--plot", str(plot)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
    assert "Consensus error per step" in run.stdout and "Delays and de-bias" in run.stdout
    rows = json.loads(records.read_text())
    assert {r["run"] for r in rows} == {"mixing", "training", "delay"}
    assert {r["topology"] for r in rows} == {"exponential", "ring", "random"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["--steps", "3", "--topology", "ring", "--sweep", "nodes=4,8",
                 "--sweep", "lr=0.01,0.1"]) == 0
    sweep = capsys.readouterr().out
    assert "Parameter deviation" in sweep and "Consensus error" not in sweep
    assert len([line for line in sweep.splitlines() if line.split()[:1] in (["4"], ["8"])]) == 4

    assert main(["--steps", "20", "--topology", "exponential", "--delay", "2",
                 "--codec", "randomk:0.2,topk:0.2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["none"], ["randomk:0.2"], ["topk:0.2"])]
    # error feedback has a row each way only where it applies; no codec moves the average
    assert [row[:2] for row in rows] == [["none", "—"], ["randomk:0.2", "—"],
                                         ["topk:0.2", "on"], ["topk:0.2", "off"]], rows
    assert all(float(row[3]) < 1e-12 for row in rows), rows


def test_delays_conserve_mass_and_need_the_debias():
    net = SimNetwork("random", 4, n=32, delay=2, seed=3)
    net.params[...] = 1.0 + np.random.default_rng(1).normal(size=net.params.shape)
    for mixer in net.mixers:
        mixer.audit = Audit()
    numerators, weight = net.mass()
    assert weight == 32
    for _ in range(25):
        net.step()
        x, w = net.mass()
        assert np.abs(x - numerators).max() <= 1e-12 and abs(w - weight) <= 1e-12
        in_flight = sum(m.audit.sent - m.audit.received for m in net.mixers)
        assert abs(in_flight[1] - net.in_flight()[1]) <= 1e-12
        assert abs(in_flight[0] - net.in_flight()[0].sum()) <= 1e-12
    assert net.in_flight()[1] > 0  # the check saw mass in flight
    net.drain()
    assert net.in_flight()[1] == 0
    assert np.abs(net.mass()[0] - numerators).max() <= 1e-12

    debiased = simulate("exponential", nodes=64, steps=40, delay=2)[-1]["consensus_error"]
    ablation = simulate("exponential", nodes=64, steps=40, delay=2, debias=False)[-1]
    assert debiased < 0.05 * ablation["consensus_error"], (debiased, ablation)


def test_custom_graphs_and_large_rings():
    graph = CustomGraph(5, [[[1, 2], [2], [3, 4], [0], [0]]])
    assert SimNetwork(graph, 2).topology is graph
    big = SimNetwork("ring", 2, n=4096)
    assert big.topology.phases[0].in_peers(0) == (4095,)
    with pytest.raises(SgpValueError, match="topology"):
        SimNetwork("exponential", 2)  # a topology by name needs n


def test_no_mpi_no_framework():
    probe = ("import sys; from hvd_sgp.sim import simulate; simulate(nodes=4, steps=2, lr=0.1);"
             "from hvd_sgp.common.mpi import MPI; assert not MPI.Is_initialized();"
             "assert not {'torch', 'tensorflow'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("topology, delay, gap", [("random", 0, 0.01), ("exponential", 2, 8e-4)])
def test_local_steps_move_the_numerators(topology, delay, gap):
    """SGP steps the numerator x = w z by the gradient step (local_update.py): wherever the
    weights leave 1 (a random directed graph, Overlap SGP's delays) the network then settles
    at the global optimum. Stepping z itself weighed each node's gradients by its weight:
    16 nodes, 800 steps, the loss 0.030 above the optimum's on the random graph and 1.1e-3
    with delays (now 2.3e-3 and 6.4e-4)."""
    records = simulate(topology=topology, nodes=16, steps=800, lr=0.02, delay=delay, seed=0)
    task = make_objective("quadratic", 16, 8, 0)
    assert records[-1]["loss"] - task.loss(task.optimum) < gap
