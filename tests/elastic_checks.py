"""Training that survives lost ranks, on real MPI processes under ULFM; run by test_elastic.py.

Each check trains a small model in a plain loop (fault-tolerant mode repairs inside the
optimizer's step) while chosen ranks die (os._exit or SIGKILL) at chosen steps; the survivors
must finish, agree on the new world and keep the PushSum ledger. Ranks are consumed as the
checks go: a launch runs the checks named on its command line, in registration order.
Open MPI 5.0's runtime counts a rank that exits non-zero twice towards the end of the job, so
a launch lets at most one rank die by os._exit(1) (the first check it runs); the rest die by
SIGKILL.
"""
import os
import signal
import sys
import time

import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common import runtime
from hvd_sgp.common.errors import OptionError
from mpi_checks import Checks

hvd.init()
torch.set_num_threads(1)
checks = Checks("elastic", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)


def die(how: str = "exit") -> None:
    sys.stdout.flush()
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def origin(rank_now: int) -> int:
    """The launch rank of the rank that is ``rank_now`` in the current world."""
    return hvd.allgather_object(runtime.origin_rank())[rank_now]


_exits = [1]  # os._exit deaths left to this launch (see the module docstring)


def how() -> str:
    """How the next victim dies: os._exit(1) once per launch, then SIGKILL."""
    if _exits[0]:
        _exits[0] -= 1
        return "exit"
    return "sigkill"


def train(opt, model, steps, kills, lr_zero=False):
    """``steps`` steps; ``kills`` maps step -> (launch ranks that die there, how)."""
    gen = torch.Generator().manual_seed(runtime.origin_rank())
    for step in range(steps):
        victims, how = kills.get(step, ((), "sigkill"))
        if runtime.origin_rank() in victims:
            die(how)
        opt.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        if not lr_zero:
            loss.backward()
        opt.step()


def make(seed=0, **sgp):
    torch.manual_seed(seed + runtime.origin_rank())  # different models: mixing has work to do
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    lr = 0.0 if sgp.pop("lr_zero", False) else 0.01
    return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), **sgp)


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ledger_holds(opt, model, before_size, lost, label):
    """After the repair: one fewer world, the same lost ranks named everywhere, the fold keeps
    the survivors' de-biased average exactly with every weight 1 (after = size x held mass /
    held weight), and with no gradient (lr 0) that mass is conserved to the end: no message in
    flight at the failure was added later, none counted twice."""
    engine = opt._sgp_session().engine
    repair = engine.repairs[-1]
    checks.verify(f"{label}: {before_size} -> {hvd.size()} ranks, lost {repair['lost']}",
                  hvd.size() == before_size - len(lost) and repair["lost"] == sorted(lost),
                  f"{repair}")
    held, after = np.array(repair["held"]), np.array(repair["after"])
    checks.verify(f"{label}: the fold keeps the survivors' average, weight {held[1]:.3f} -> "
                  f"{after[1]:.0f}", abs(after[0] / after[1] - held[0] / held[1]) < 1e-5
                  and after[1] == hvd.size(), f"held {held} after {after}")
    opt.synchronize_gossip()
    weight = float(engine.buffers[0][-1])
    mass = hvd.allreduce(torch.tensor([weight * float(params(model).sum()), weight],
                                      dtype=torch.float64), op=hvd.Sum)
    checks.verify(f"{label}: mass conserved through the rest of the run "
                  f"(sum w z {mass[0]:.6f}, sum w {mass[1]:.3f})",
                  abs(float(mass[0]) - after[0]) < 1e-4 * max(1.0, abs(after[0]))
                  and abs(float(mass[1]) - hvd.size()) < 1e-9, f"{mass.tolist()}")


@checks
def check_sync_sgp_ledger():
    """Synchronous SGP, pure mixing (lr 0): a rank killed at step 5."""
    size, victim = hvd.size(), origin(hvd.size() - 1)
    model, opt = make(lr_zero=True)
    train(opt, model, 25, {5: ((victim,), how())}, lr_zero=True)
    ledger_holds(opt, model, size, [victim], "sync SGP")
    spread = hvd.allreduce(params(model), op=hvd.Max) - hvd.allreduce(params(model), op=hvd.Min)
    checks.verify("sync SGP: the survivors agree on the model after the repair",
                  float(spread.abs().max()) < 1e-5, f"{float(spread.abs().max())}")


@checks
def check_overlap_tau2_ledger():
    """Overlap SGP with tau = 2, pure mixing: messages in flight to and from the dead rank."""
    size, victim = hvd.size(), origin(1)
    model, opt = make(overlap=True, max_delay=2, lr_zero=True)
    train(opt, model, 25, {6: ((victim,), how())}, lr_zero=True)
    ledger_holds(opt, model, size, [victim], "overlap tau=2")


@checks
def check_random_k_overlap_repair():
    """Random-k under Overlap SGP tau = 2, pure mixing: every run of entries has a weight of
    its own. The repair folds the survivors' run weights in (after it every weight is 1), so
    from there on each entry's weights sum to the survivors' number, and an exact average
    leaves one model."""
    size, victim = hvd.size(), origin(2)
    model, opt = make(overlap=True, max_delay=2, lr_zero=True,
                      compression=hvd.Compression.randomk(0.5))
    train(opt, model, 25, {6: ((victim,), how())}, lr_zero=True)
    engine = opt._sgp_session().engine
    opt.synchronize_gossip()
    weights = hvd.allreduce(torch.from_numpy(engine.mixers[0].entry_weights()), op=hvd.Sum)
    opt.average_parameters()
    spread = hvd.allreduce(params(model), op=hvd.Max) - hvd.allreduce(params(model), op=hvd.Min)
    checks.verify(f"random-k osgp: {size} -> {hvd.size()} ranks, each entry's weights sum to "
                  f"{float(weights.min()):.6f}..{float(weights.max()):.6f}, one model after "
                  f"the average", hvd.size() == size - 1
                  and engine.repairs[-1]["lost"] == [victim]
                  and float((weights - hvd.size()).abs().max()) < 1e-9
                  and float(spread.abs().max()) < 1e-6,
                  f"spread {float(spread.abs().max())}")


@checks
def check_outer_optimizer_repair():
    """Gossip DiLoCo (H = 4) with a rank killed between syncs: the fold replaces every model
    by the survivors' average and the outer state starts afresh (the next sync records the
    anchors again), the weights sum to the survivors' number and training goes on."""
    size, victim = hvd.size(), origin(hvd.size() - 1)
    model, opt = make(local_steps=4, outer_optimizer="diloco")
    engine, after_repair = opt._sgp_session().engine, None
    for step in range(26):
        train(opt, model, 1, {0: ((victim,), how())} if step == 6 else {})
        if engine.repairs and after_repair is None:  # the step that repaired
            after_repair = (engine.outer.anchor, engine.outer.state())
    weight = hvd.allreduce(torch.tensor([float(engine.buffers[0][-1])], dtype=torch.float64),
                           op=hvd.Sum)
    momentum = engine.outer.state()["momentum"][0]
    checks.verify(f"gossip DiLoCo: {size} -> {hvd.size()} ranks at iteration "
                  f"{engine.repairs[-1]['iteration']}, outer state empty after the fold, "
                  f"weights sum to {float(weight):.6f}, outer momentum again later",
                  hvd.size() == size - 1 and engine.repairs[-1]["lost"] == [victim]
                  and after_repair == (None, None) and abs(float(weight) - hvd.size()) < 1e-9
                  and np.abs(momentum).max() > 0 and bool(torch.isfinite(params(model)).all()),
                  f"after the repair {after_repair}")


@checks
def check_repairs_in_vain_end_the_job():
    """Repairs in a row that find nobody lost (rank 0 takes something for a lost peer before
    each) end in an SgpError on every rank at the REPAIRS_IN_VAIN-th, naming what the rank
    noticed, rather than go on for ever; the world they leave still works."""
    from hvd_sgp.common import place, recovery
    from hvd_sgp.common.errors import SgpError
    size, repairs, error, lost = hvd.size(), 0, None, set()
    # A rank that leaves a collective first may revoke the world (its false alarm, its
    # repair) while another is still completing it (the barrier that ended the check before:
    # it raised PeerLostError there once). An agreement completes on a revoked world.
    place.world_comm().Agree(1)
    while error is None and repairs <= recovery.REPAIRS_IN_VAIN:
        if hvd.rank() == 0:
            recovery.lost("a false alarm of this check")  # (revokes the world)
        repairs += 1
        try:
            lost.update(runtime.repair().lost)
        except SgpError as caught:
            error = caught
    total = float(hvd.allreduce(torch.ones(1), op=hvd.Sum))
    said = "noticed: a false alarm of this check)" if hvd.rank() == 0 else "noticed: "
    checks.verify(f"{repairs} repairs that found nobody lost end in SgpError on rank "
                  f"{hvd.rank()}, and the {hvd.size()} ranks go on communicating",
                  error is not None and repairs == recovery.REPAIRS_IN_VAIN and not lost
                  and said in str(error) and error.rank == hvd.rank() and hvd.size() == size
                  and total == size, str(error))


@checks
def check_allreduce_stage():
    """A schedule's AllReduce stage: the survivors' models stay identical after the repair."""
    size, victim = hvd.size(), origin(hvd.size() // 2)
    model, opt = make(schedule="0:sgp1,4s:allreduce")
    train(opt, model, 20, {8: ((victim,), how())})
    different = hvd.allreduce(params(model), op=hvd.Max) - hvd.allreduce(params(model), op=hvd.Min)
    checks.verify(f"allreduce stage: {size} -> {hvd.size()} ranks, models identical at the end "
                  f"(max difference {float(different.abs().max()):.1e})",
                  hvd.size() == size - 1 and float(different.abs().max()) < 1e-6
                  and opt.metrics()["mode"] == "allreduce")


@checks
def check_two_failures_in_a_row():
    """Two ranks lost three steps apart: two repairs."""
    size = hvd.size()
    first, second = origin(1), origin(hvd.size() - 1)
    model, opt = make()
    train(opt, model, 25, {4: ((first,), how()), 7: ((second,), "sigkill")})
    lost = [r for repair in opt._sgp_session().engine.repairs for r in repair["lost"]]
    checks.verify(f"two in a row: {size} -> {hvd.size()} ranks, lost {lost}",
                  hvd.size() == size - 2 and sorted(lost) == sorted([first, second]))


@checks
def check_failure_during_repair():
    """A second rank dies inside the repair of the first failure: the repair starts over."""
    size = hvd.size()
    first, second = origin(hvd.size() - 1), origin(1)

    def die_inside_the_repair(change):
        if runtime.origin_rank() == second:
            die("sigkill")

    runtime.on_world_change(die_inside_the_repair)  # before the optimizer's: called first
    model, opt = make()
    train(opt, model, 20, {3: ((first,), how())})
    lost = sorted(r for repair in opt._sgp_session().engine.repairs for r in repair["lost"])
    checks.verify(f"failure during the repair: {size} -> {hvd.size()} ranks, lost {lost}",
                  hvd.size() == size - 2 and lost == sorted([first, second]))


@checks
def check_kill_at_step_0():
    """A rank that dies before the first step (right after the optimizer was made)."""
    size, victim = hvd.size(), origin(hvd.size() - 1)
    model, opt = make()
    train(opt, model, 12, {0: ((victim,), how())})
    checks.verify(f"kill at step 0: {size} -> {hvd.size()} ranks",
                  hvd.size() == size - 1 and opt._sgp_session().engine.steps >= 11)


@checks
def check_frozen_rank_is_excluded():
    """A rank that stays alive but silent (sleeps) is declared failed after HVD_SGP_TIMEOUT,
    excludes itself, and the others go on."""
    size, victim = hvd.size(), origin(hvd.size() - 1)
    model, opt = make()
    began = time.monotonic()
    gen = torch.Generator().manual_seed(1)
    for step in range(15):
        if step == 4 and runtime.origin_rank() == victim:
            time.sleep(3600)  # the watchdog ends this process
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
    took = time.monotonic() - began
    checks.verify(f"frozen rank: {size} -> {hvd.size()} ranks in {took:.0f} s",
                  hvd.size() == size - 1)


@checks
def check_a_spare_killed_after_saying_it_is_ready_is_dead_not_a_lost_peer():
    """A spare's word that came just before it died still matches a probe, but MPI refuses
    to receive it (MPI_ERR_PROC_FAILED). The commit's look at the replacements must take that
    spare for dead and the replacements in, not raise: raised, it was a lost peer in which
    the repair found nobody lost, at every commit after (a chaos run, 10 repairs in a row)."""
    from hvd_sgp.common import spares
    from hvd_sgp.common.mpi import MPI
    outcome = None
    if hvd.rank() == 0:
        child = ("import os, signal, time\nfrom mpi4py import MPI\n"
                 f"MPI.Comm.Get_parent().Send(bytearray(1), dest=0, tag={spares._READY})\n"
                 "time.sleep(1)\nos.kill(os.getpid(), signal.SIGKILL)\n")
        info = MPI.Info.Create()
        info.Set("map_by", ":OVERSUBSCRIBE")  # (as spares.replenish: the slots are taken)
        inter = MPI.COMM_SELF.Spawn(sys.executable, ["-c", child], 1, info)
        info.Free()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        deadline = time.monotonic() + 60
        while spares._sent(inter, spares._READY) is False and time.monotonic() < deadline:
            time.sleep(0.01)  # (its word has come: a probe matches it)
        while spares._alive(inter) and time.monotonic() < deadline:
            time.sleep(0.05)  # (its death is known)
        pool, spares._pool[:] = spares._pool[:], [spares.Spare("port", "host", None, inter)]
        try:
            outcome = (spares.ready(MPI.COMM_SELF, [None], False), spares._pool[0].ready)
        except MPI.Exception as error:
            outcome = error.Get_error_string()
        finally:
            spares._pool[:] = pool
    checks.verify("a spare killed after saying it is ready: taken for dead, its replacement "
                  "taken in, no lost peer", hvd.rank() != 0 or outcome == (True, False),
                  str(outcome))


@checks
def check_needs_ulfm_flags():
    """HVD_SGP_FAULT_TOLERANT=1 under an mpirun without ULFM names the missing flags."""
    from hvd_sgp.common import fault_mode

    from mpi_checks import expect_error
    error = expect_error(OptionError, lambda: fault_mode.check_support({}), rank=hvd.rank())
    checks.verify("fault-tolerant mode without ULFM's flags: OptionError naming them",
                  "--with-ft ulfm" in str(error) and "mpi_ft_detector" in str(error))


checks.run()
