"""Horovod's checkpoint recipes on real MPI processes, written as Horovod's examples write them;
run by test_resume.py. argv: PHASE DIR [check names...].

PHASE ``save`` (a first launch): for every SGP mode, train, rank 0 writes a Horovod checkpoint
(model and optimizer state_dict), train on and keep each rank's final parameters.
PHASE ``resume`` (a second launch): rank 0 finds the checkpoint, loads it, and every rank calls
broadcast_parameters and broadcast_optimizer_state, then trains the same steps.
PHASE ``inline``: the recipe inside one launch (rebuilt optimizers), interop with plain torch
checkpoints and LR schedulers, and ranks that disagree on where they are.
"""
import copy
import gc
import os
import sys
import time
import weakref

import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common import runtime
from hvd_sgp.common.errors import ConsistencyError
from mpi_checks import Checks, expect_error

phase, folder = sys.argv[1], sys.argv[2]
hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
one_node = runtime.layout().cross.Get_size() == 1  # every rank one SGP node: no gossip
checks = Checks(f"resume {phase}", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
TIMEOUT = 30.0  # seconds a rank waits on a silent peer: a hang shows as a failure

MODES = {
    "sgp": dict(),
    "random": dict(topology="random"),  # not doubly stochastic: the weights move
    "osgp1": dict(overlap=True, max_delay=1),
    "osgp2": dict(overlap=True, max_delay=2, topology="random"),
    "allreduce": dict(mode="allreduce"),
    "schedule": dict(schedule="0:sgp,4s:allreduce,9s:osgp1"),
    "int8": dict(compression=hvd.Compression.int8, topology="random"),
    "topk": dict(compression=hvd.Compression.topk(0.25), overlap=True, max_delay=2),
    "randomk": dict(compression=hvd.Compression.randomk(0.5), topology="random"),
    "slowmo": dict(local_steps=2, slowmo=0.5),
}
STEPS = 7  # before and after the checkpoint


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def build(mode: str, seed: int):
    model = mlp(seed)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), timeout=TIMEOUT,
                                   **MODES[mode])
    return model, opt


def train(model, opt, first: int, last: int) -> None:
    """Steps ``first`` .. ``last - 1``, each on data fixed by (step, rank): a resumed run sees
    what the uninterrupted one saw. ``opt``: one optimizer or several, each stepped."""
    opts = opt if isinstance(opt, (list, tuple)) else [opt]
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 * step + me)
        x = torch.randn(8, 4, generator=gen)
        for o in opts:
            o.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
        for o in opts:
            o.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def momentum(opt) -> torch.Tensor:
    return torch.cat([s["momentum_buffer"].reshape(-1) for s in opt.state.values()])


def path(name: str) -> str:
    return os.path.join(folder, name)


def consistent(model, opt, iteration: int) -> tuple:
    """After Horovod's two broadcasts: (every rank at ``iteration`` with weight 1 and root's
    parameters and momentum, detail)."""
    state = opt.sgp_state()
    root = hvd.broadcast_object((flat(model), momentum(opt)), root_rank=0)
    good = (state["iteration"] == iteration and all(w == 1.0 for w in state["weights"])
            and torch.equal(flat(model), root[0]) and torch.equal(momentum(opt), root[1]))
    return good, f"iteration {state['iteration']} weights {state['weights']}"


def mass_kept(opt) -> tuple:
    """With nothing in flight the PushSum weights add up to the number of ranks (each rank
    of a node holds its shard's weight): no mass was lost or counted twice."""
    opt.synchronize_gossip()
    total = sum(sum(w) for w in hvd.allgather_object(opt.sgp_state()["weights"]))
    return abs(total - n * len(opt.sgp_state()["weights"])) < 1e-6, f"sum of weights {total}"


def horovod_resume(model, opt, checkpoint: str) -> int:
    """pytorch_imagenet_resnet50.py's resume: rank 0 finds and loads the checkpoint, then every
    rank takes root's model and optimizer. Returns the resumed epoch."""
    resume_from_epoch = 0
    if me == 0 and os.path.exists(checkpoint):
        resume_from_epoch = 1
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name="resume_from_epoch").item()
    if resume_from_epoch > 0 and me == 0:
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return resume_from_epoch


# --- two launches ----------------------------------------------------------------------------
@checks.when(phase == "save")
def check_save_rank0_checkpoints():
    for mode in MODES:
        model, opt = build(mode, 0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        train(model, opt, 0, STEPS)
        if me == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1},
                       path(f"checkpoint-{mode}.pth.tar"))
        train(model, opt, STEPS, 2 * STEPS)
        torch.save(flat(model), path(f"final-{mode}-{me}.pt"))
        del model, opt  # dropped and collected: the next mode's optimizer starts cleanly
        gc.collect()
    return f"rank 0 saved a Horovod checkpoint in {len(MODES)} modes"


@checks.when(phase == "resume")
def check_resume_rank0_checkpoints():
    for mode in MODES:
        model, opt = build(mode, 100 + me)  # a different start on every rank: root's wins
        began = time.perf_counter()
        assert horovod_resume(model, opt, path(f"checkpoint-{mode}.pth.tar")) == 1
        saved = torch.load(path(f"checkpoint-{mode}.pth.tar"))["optimizer"]["hvd_sgp"]
        checks.verify(f"{mode}: after the two broadcasts every rank stands at root's "
                      f"iteration {saved['iteration']} with weight 1, root's model and "
                      "momentum", *consistent(model, opt, saved["iteration"]))
        train(model, opt, STEPS, 2 * STEPS)
        checks.verify(f"{mode}: {STEPS} more steps in step on every rank "
                      f"({time.perf_counter() - began:.1f} s)", *mass_kept(opt))
        if one_node or mode == "allreduce":  # every rank holds the model: Horovod's resume
            full = torch.load(path(f"final-{mode}-{me}.pt"))
            checks.verify(f"{mode}: the resumed run equals the uninterrupted one",
                          torch.allclose(flat(model), full, atol=1e-6, rtol=0),
                          f"max difference {(flat(model) - full).abs().max():.2e}")
        del model, opt
        gc.collect()


# --- one launch ------------------------------------------------------------------------------
@checks.when(phase == "inline")
def check_rebuild_mid_run():
    """pytorch_imagenet_resnet50.py's recipe inside one run: rank 0 saves, every rank builds
    a new model and DistributedOptimizer (the old one dropped), rank 0 loads, two broadcasts."""
    for mode in ("random", "osgp2", "int8", "slowmo"):
        model, opt = build(mode, me)
        train(model, opt, 0, 5)
        buffer = path(f"inline-{mode}.pt")
        if me == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        hvd.barrier()
        old = weakref.ref(opt._sgp_session())
        model, opt = build(mode, 200 + me)  # the old optimizer goes with its last reference
        gc.collect()
        assert horovod_resume(model, opt, buffer) == 1
        checks.verify(f"{mode}: the rebuilt optimizer starts at root's iteration",
                      *consistent(model, opt, 5))
        train(model, opt, 5, 10)
        checks.verify(f"{mode}: the dropped optimizer's session was closed (its first step)",
                      old() is None or old().closed)
        checks.verify(f"{mode}: the rebuilt optimizer trains in step", *mass_kept(opt))


def layer_optimizer(layer, cls=torch.optim.SGD, **kw):
    return hvd.DistributedOptimizer(cls(layer.parameters(), lr=0.01, **kw),
                                    named_parameters=layer.named_parameters(),
                                    topology="random", overlap=True, timeout=TIMEOUT)


@checks.when(phase == "inline")
def check_second_optimizer_for_fine_tuning():
    """Two DistributedOptimizers side by side (body and head, each its own session, both
    Overlap SGP); the body's dropped mid-run with gossip in flight and a new one (Adam, for
    fine-tuning) built in its place: every session keeps its own count, in step on every rank."""
    model = mlp(me)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    body, head = layer_optimizer(model[0], momentum=0.9), layer_optimizer(model[2])
    train(model, [body, head], 0, 4)
    counts = [body.sgp_state()["iteration"], head.sgp_state()["iteration"]]
    old = weakref.ref(body._sgp_session())
    del body
    gc.collect()
    body = layer_optimizer(model[0], torch.optim.Adam)
    train(model, [body, head], 4, 7)
    counts += [body.sgp_state()["iteration"], head.sgp_state()["iteration"]]
    body.synchronize_gossip()
    checks.verify("two optimizers side by side; one dropped and rebuilt (Adam) mid-run",
                  counts == [4, 4, 3, 7] and (old() is None or old().closed)
                  and mass_kept(head)[0] and mass_kept(body)[0], str(counts))


@checks.when(phase == "inline")
def check_ranks_out_of_step_are_named():
    """Ranks that load checkpoints of different iterations (rank 0 only, without the
    broadcasts; or per-rank files of different steps): the first step raises on every rank,
    naming each rank's iteration, at once instead of after the timeout; the broadcasts then
    bring the ranks back in step."""
    model, opt = build("random", me)
    train(model, opt, 0, 2)
    saved = {"model": model.state_dict(), "optimizer": copy.deepcopy(opt.state_dict())}
    saved["optimizer"]["hvd_sgp"]["iteration"] = 44 + me  # rank r's file is of step 44 + r
    for loaders in ([0], list(range(n))):
        model, opt = build("random", me)  # a new run of the script
        if me in loaders:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        began = time.perf_counter()
        error = expect_error(ConsistencyError, lambda: train(model, opt, 2, 3), rank=me)
        seconds = time.perf_counter() - began
        wanted = [f"rank {r} at iteration {44 + r if r in loaders else 0}" for r in range(n)]
        checks.verify(f"loaded on ranks {loaders}: every rank fails in {seconds:.2f} s "
                      f"(timeout {TIMEOUT:.0f} s), naming each rank's iteration",
                      all(w in str(error) for w in wanted) and seconds < TIMEOUT / 3,
                      str(error))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt, 3, 6)
        checks.verify("the broadcasts put them back in step",
                      opt.sgp_state()["iteration"] == 47 and mass_kept(opt)[0])


@checks.when(phase == "inline")
def check_every_rank_loads_rank0_file():
    """A script that loads rank 0's checkpoint file on every rank, without the broadcasts:
    same iteration everywhere, but rank 0's weights and copies are its own only. Per-rank
    state then starts afresh on every rank, so the weights still add up."""
    for mode in ("osgp1", "int8"):  # (Overlap SGP always tracks the weight)
        model, opt = build(mode, me)
        train(model, opt, 0, 5)
        file = path(f"shared-{mode}.pt")
        if me == 0:
            state = opt.state_dict()  # as a run of more nodes, whose weights moved, saves it
            state["hvd_sgp"]["weights"] = [w / 2 for w in state["hvd_sgp"]["weights"]]
            torch.save({"model": model.state_dict(), "optimizer": state}, file)
        hvd.barrier()
        saved = torch.load(file)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        train(model, opt, 5, 9)
        checks.verify(f"{mode}: rank 0's file (weight "
                      f"{saved['optimizer']['hvd_sgp']['weights'][0]}) loaded on every rank "
                      "keeps the mass", *mass_kept(opt))


@checks.when(phase == "inline")
def check_plain_torch_checkpoints_interoperate():
    """Real Horovod writes a plain optimizer state_dict: it loads into hvd_sgp's optimizer
    (rank 0, then the broadcasts); hvd_sgp's state_dict loads into plain torch.optim."""
    model = mlp(0)
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        plain.step()
    file = path("horovod-written.pt")
    if me == 0:
        torch.save({"model": model.state_dict(), "optimizer": plain.state_dict()}, file)
    hvd.barrier()
    saved = torch.load(file)
    model2, opt = build("random", 300 + me)
    if me == 0:
        model2.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    checks.verify("a plain (Horovod-written) state_dict loads on rank 0 and reaches every rank",
                  torch.equal(momentum(opt), momentum(plain))
                  and torch.equal(flat(model2), flat(model)) and consistent(model2, opt, 0)[0])
    train(model2, opt, 0, 3)
    ours = opt.state_dict()
    back = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    back.load_state_dict(ours)
    checks.verify("hvd_sgp's state_dict loads into plain torch.optim.SGD",
                  torch.equal(momentum(back), momentum(opt))
                  and back.param_groups[0]["lr"] == 0.05 and "hvd_sgp" not in back.state_dict())


@checks.when(phase == "inline")
def check_lr_scheduler_save_and_load():
    """An LR scheduler around the DistributedOptimizer saves and loads as under Horovod: rank 0
    loads both, the optimizer's broadcast carries the learning rate, the scheduler's state
    goes by broadcast_object; the resumed schedule goes on as the uninterrupted one."""
    model, opt = build("sgp", me)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rates = []
    for step in range(8):
        train(model, opt, step, step + 1)
        scheduler.step()
        rates.append(opt.param_groups[0]["lr"])
        if step == 4 and me == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": scheduler.state_dict()}, path("scheduled.pt"))
    hvd.barrier()
    model, opt = build("sgp", me)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if me == 0:
        saved = torch.load(path("scheduled.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    scheduler.load_state_dict(hvd.broadcast_object(scheduler.state_dict(), root_rank=0))
    resumed = [opt.param_groups[0]["lr"]]
    for step in range(5, 8):
        train(model, opt, step, step + 1)
        scheduler.step()
        resumed.append(opt.param_groups[0]["lr"])
    checks.verify("StepLR around the DistributedOptimizer resumes its schedule",
                  resumed == rates[4:] and opt.sgp_state()["iteration"] == 8,
                  f"{resumed} against {rates[4:]}")


checks.run(sys.argv[3:])
