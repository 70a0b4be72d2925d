"""Outer optimizers (DiLoCo) on real MPI processes; run by test_outer.py.

outer_optimizer='diloco' with local_steps=8 over both averaging paths: exact AllReduce (every
rank holds one model after each sync, and only then) and one PushSum round (bytes only at
syncs, the weights still sum to n); both train. A torch optimizer factory computes what the
numpy preset computes; 'sgd:1' is plain Local SGD; streaming fragments send 1/P of the model at
the busiest step; under Overlap SGP the outer step lands tau steps after its round, on the
synchronous trajectory when no progress is made meanwhile; the outer state resumes exactly from
a checkpoint; bad input fails at construction naming the rank.
"""
import copy

import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common.errors import OptionError, SgpValueError
from mpi_checks import Checks, expect_error

hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
checks = Checks("outer", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
H = 8
EVAL = torch.randn(256, 4, generator=torch.Generator().manual_seed(1234))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def mlp(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def target(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.tensor([[0.5], [-1.0], [0.25], [1.5]])


def loss_of(model) -> float:
    """The loss on one fixed set, averaged over the ranks' models."""
    with torch.no_grad():
        mine = torch.nn.functional.mse_loss(model(EVAL), target(EVAL)).item()
    return float(np.mean(hvd.allgather_object(mine)))


def step(opt, model, gen) -> None:
    x = torch.randn(16, 4, generator=gen) + 0.3 * me  # each rank its own data
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), target(x)).backward()
    opt.step()


def run(steps: int, seed: int = 0, inner=None, hidden: int = 16, **sgp):
    """Train ``steps`` from a common start; per step: (all ranks equal, bytes so far, weight)."""
    model = mlp(7, hidden)
    opt = hvd.DistributedOptimizer((inner or (lambda p: torch.optim.SGD(p, lr=0.1)))(
        model.parameters()), **sgp)
    gen = torch.Generator().manual_seed(100 * seed + me)
    trace = []
    for _ in range(steps):
        step(opt, model, gen)
        models = hvd.allgather_object(flat(model))
        trace.append((all(torch.equal(models[0], m) for m in models),
                      opt.metrics()["bytes_sent"], opt.metrics()["weight"]))
    return model, opt, trace


@checks
def check_bad_input():
    def wrap(**sgp):
        return lambda: hvd.DistributedOptimizer(torch.optim.SGD(mlp(0).parameters(), lr=0.1),
                                                **sgp)

    for bad in ("adam", "nesterov:0.7", "sgd:0", "heavyball:1:1.5", 3):
        expect_error(OptionError, wrap(outer_optimizer=bad), rank=me)
    expect_error(SgpValueError, wrap(outer_optimizer="diloco", slowmo=0.5), rank=me)
    expect_error(OptionError, wrap(outer_fragments=0), rank=me)
    expect_error(SgpValueError, wrap(local_steps=H, outer_fragments=2 * H), rank=me)
    expect_error(SgpValueError, wrap(local_steps=H, outer_fragments=2, slowmo=0.5), rank=me)
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   outer_optimizer=lambda params: "not an optimizer")
    gen = torch.Generator().manual_seed(0)
    step(opt, model, gen)  # the first sync records the anchor
    expect_error(SgpValueError, lambda: step(opt, model, gen), rank=me)
    return ("unknown specs, bad LR/MOMENTUM, slowmo with outer_optimizer, outer_fragments "
            "< 1 or > local_steps or with slowmo, a factory that returns no optimizer: errors "
            "naming the rank")


@checks
def check_diloco_over_allreduce():
    """DiLoCo proper: Local SGD averages exactly every H steps, then the Nesterov step."""
    before = loss_of(mlp(7))
    model, opt, trace = run(6 * H, mode="allreduce", local_steps=H, outer_optimizer="diloco")
    after = loss_of(model)
    equal = [same for same, _, _ in trace]
    synced = [k % H == H - 1 for k in range(len(trace))]
    assert n == 1 or equal == synced, equal
    assert after < 0.5 * before, (before, after)
    state = opt.state_dict()["hvd_sgp"]["outer"]
    assert np.abs(state["momentum"][0]).max() > 0 and len(state["anchor"]) == 1
    return (f"diloco over AllReduce, H={H}: one model after each sync only; loss {before:.3f} "
            f"-> {after:.3f}")


@checks
def check_diloco_over_gossip():
    """Gossip DiLoCo: one PushSum round every H steps (synchronous, and Overlap SGP, which
    completes the round first), the outer step on the de-biased mix."""
    before, lines = loss_of(mlp(7)), []
    for label, overlap in (("sync", {}), ("overlap tau=2", dict(overlap=True, max_delay=2))):
        model, opt, trace = run(6 * H, mode="sgp", local_steps=H, outer_optimizer="diloco",
                                topology="random", **overlap)
        after = loss_of(model)
        sent = [b for _, b, _ in trace]
        grew = [b > a for a, b in zip([0] + sent, sent)]
        assert n == 1 or grew == [k % H == H - 1 for k in range(len(trace))], grew
        local = opt._sgp_session().engine.local.Get_size()  # ranks sharing a node's weight
        total = sum(hvd.allgather_object(trace[-1][2] / local))
        assert abs(total - n / local) < 1e-9, total  # the outer step leaves the weights alone
        assert after < 0.5 * before, (label, before, after)
        opt.average_parameters()
        lines.append(f"{label}: the nodes' weights sum to {total:.12f}, loss {before:.3f} -> "
                     f"{after:.3f} ({loss_of(model):.3f} averaged)")
    return f"diloco over PushSum gossip, H={H}, bytes only at syncs; " + "; ".join(lines)


@checks
def check_overlapped_outer_step_lands_later_with_the_progress():
    """Overlap SGP delays each outer step (plain Local SGD's sync too) by tau steps, its
    round running beside them. With the inner lr 0 in those tau steps (no progress while the
    round is out), the trajectory is the synchronous run's, step by step; with progress, the
    run still trains and every piece's weights still sum to the number of nodes."""
    tau, lines = 2, []

    def trained(quiet: bool, outer, **sgp):
        model = mlp(7)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       mode="sgp", local_steps=H, outer_optimizer=outer,
                                       **sgp)
        gen = torch.Generator().manual_seed(me)
        trace = []
        for k in range(4 * H):
            still = quiet and k >= H and k % H < tau  # the tau steps after a sync
            opt.param_groups[0]["lr"] = 0.0 if still else 0.1
            step(opt, model, gen)
            trace.append(flat(model))
        return model, opt, trace

    before = loss_of(mlp(7))
    for outer, exact in (("diloco", True), (None, False)):  # (Local SGD: 'sgd:1', rounded)
        _, _, sync = trained(True, outer)
        _, _, overlapped = trained(True, outer, overlap=True, max_delay=tau)
        landed = [k for k in range(4 * H) if (k + 1) % H >= tau]  # (else: a round is out)
        gap = max((sync[k] - overlapped[k]).abs().max().item() for k in landed)
        assert gap == 0 if exact else gap < 1e-6, (outer, gap)
        model, opt, _ = trained(False, outer, overlap=True, max_delay=tau)
        engine = opt._sgp_session().engine
        assert engine.outer.delay == (tau if engine.mixers else 0), engine.outer.delay
        assert engine.outer.pending == bool(engine.mixers)  # the last sync's round is out
        engine.drain()  # lands it
        assert not engine.outer.pending
        local = engine.local.Get_size()
        weights = [float(m.buffer[-1]) for m in engine.mixers]
        totals = (np.sum(hvd.allgather_object(np.array(weights) / local), axis=0)
                  if weights else [])
        assert all(abs(t - n / local) < 1e-9 for t in totals), totals
        after = loss_of(model)
        assert after < 0.5 * before, (outer, before, after)
        lines.append(f"{outer or 'Local SGD'}: no progress meanwhile: the synchronous "
                     f"trajectory to {gap:.1e}; with it loss {before:.3f} -> {after:.3f}")
    return (f"overlap tau={tau}: the outer step lands {tau} steps after its round, each "
            f"piece's weights sum to {n // local}; " + "; ".join(lines))


def nesterov(params) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer, as a torch factory."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@checks
def check_factory_equals_preset():
    """A torch factory for DiLoCo's optimizer takes the numpy preset's steps; 'sgd:1' is the
    averaged model itself (Local SGD)."""
    diffs = {}
    for mode in ("allreduce", "sgp"):
        preset, _, _ = run(3 * H, mode=mode, local_steps=H, outer_optimizer="diloco")
        torch_made, _, _ = run(3 * H, mode=mode, local_steps=H, outer_optimizer=nesterov)
        diffs[f"factory {mode}"] = (flat(preset) - flat(torch_made)).abs().max().item()
        local, _, _ = run(3 * H, mode=mode, local_steps=H)
        identity, _, _ = run(3 * H, mode=mode, local_steps=H, outer_optimizer="sgd:1")
        diffs[f"sgd:1 {mode}"] = (flat(local) - flat(identity)).abs().max().item()
    assert max(diffs.values()) < 1e-6, diffs
    return f"torch factory == 'diloco', 'sgd:1' == Local SGD: {diffs}"


def small_steps(params) -> torch.optim.Optimizer:
    """The wide model's inner optimizer (lr 0.1 diverges with 256 tanh units)."""
    return torch.optim.SGD(params, lr=0.01)


@checks
def check_streaming_fragments():
    """outer_fragments=P: fragment p gossips (or is averaged exactly) at the steps congruent
    to p*H//P modulo H; the busiest step sends 1/P of the model (the transport's count) and
    the run's total stays that of whole-model syncs every H steps; both modes train."""
    before, peaks, totals, lines = loss_of(mlp(7, 256)), {}, {}, []
    for fragments in (1, 2, 4):
        model, _, trace = run(4 * H, mode="sgp", local_steps=H, outer_optimizer="nesterov:0.5:0.8",
                              outer_fragments=fragments, hidden=256, inner=small_steps)
        sent = np.diff([0] + [b for _, b, _ in trace])
        offsets = {p * H // fragments for p in range(fragments)}
        assert n == 1 or [k for k, b in enumerate(sent, 1) if b > 0] == [
            k for k in range(1, 4 * H + 1) if k % H in offsets], sent
        peaks[fragments], totals[fragments] = int(sent.max()), int(sent.sum())
        after = loss_of(model)
        assert after < 0.5 * before, (fragments, before, after)
        lines.append(f"P={fragments}: peak {peaks[fragments]} B/step, loss {after:.3f}")
    for fragments in (2, 4):
        assert n == 1 or peaks[1] / peaks[fragments] > 0.99 * fragments, peaks
        assert abs(totals[fragments] / max(totals[1], 1) - 1) < 0.01, totals
    model, _, trace = run(4 * H, mode="allreduce", local_steps=H, outer_fragments=4,
                          outer_optimizer="nesterov:0.5:0.8", hidden=256, inner=small_steps)
    after = loss_of(model)
    assert after < 0.5 * before and not any(same for same, _, _ in trace[H:]), after
    return (f"streaming fragments over gossip, H={H}, loss from {before:.3f}: "
            + "; ".join(lines) + f"; over AllReduce P=4: loss {after:.3f}")


def snapshot_resume(**sgp) -> float:
    """Train, snapshot, train on; restore the snapshot and train the same again: the largest
    difference between the two endings."""
    model = mlp(50 + me)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), **sgp)
    gen = torch.Generator().manual_seed(60 + me)
    for _ in range(2 * H + 3):
        step(opt, model, gen)
    state, params = copy.deepcopy(opt.state_dict()), flat(model).clone()
    gen_state = gen.get_state()
    for _ in range(2 * H):
        step(opt, model, gen)
    after = flat(model).clone()
    with torch.no_grad():  # in place: the parameters are views into hvd_sgp's buffer
        offset = 0
        for p in model.parameters():
            p.copy_(params[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    opt.load_state_dict(state)
    gen.set_state(gen_state)
    for _ in range(2 * H):
        step(opt, model, gen)
    return (flat(model) - after).abs().max().item()


@checks
def check_outer_state_resumes_exactly():
    diffs = {name: snapshot_resume(**sgp) for name, sgp in (
        ("diloco allreduce", dict(mode="allreduce", local_steps=H, outer_optimizer="diloco")),
        ("diloco gossip", dict(local_steps=H, outer_optimizer="diloco")),
        ("diloco gossip int8", dict(local_steps=H, outer_optimizer="diloco",
                                    compression=hvd.Compression.int8)),
        ("torch AdamW factory", dict(local_steps=H, outer_optimizer=lambda p:
                                     torch.optim.AdamW(p, lr=0.1))),
        ("diloco gossip 4 fragments", dict(local_steps=H, outer_optimizer="diloco",
                                           outer_fragments=4)))}
    assert max(diffs.values()) < 1e-6, diffs
    return f"the outer state resumes exactly from a checkpoint: {diffs}"


checks.run()
