"""Uneven workers (samples_per_step, hvd_sgp/common/uneven.py) on real MPI processes; run by
test_uneven.py.

Rank i minimises 0.5 |z - a_i|^2 with b_i samples per step (b = 1, 2, 3, 6, ...), so the
sample-weighted optimum sum_i b_i a_i / sum_i b_i is far from the plain mean of the a_i. With
``samples_per_step`` every exchange (SGP, Overlap SGP, Local SGD and an outer optimizer over
gossip, streamed fragments, AllReduce SGD, Local SGD over AllReduce) ends at the weighted
optimum; without it, at the plain mean (the check could fail). On a random directed graph and
under Overlap SGP, where the PushSum weights leave 1, both hold only because a local step moves
the numerator (local_update.py). The PushSum weights still sum to n exactly; equal samples
leave the trajectory bit for bit as without the option; with a rank joined, the others' sum
is their own sample-weighted mean; a rank that leaves the option out fails at construction
on every rank.
"""
import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common.errors import ConsistencyError, OptionError
from mpi_checks import Checks, expect_error

hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
checks = Checks("uneven", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
DIM = 5
SAMPLES = [1, 2, 3, 6, 1, 2, 3, 6][:n]
TARGETS = np.random.default_rng(0).normal(size=(n, DIM)) * 3  # a_i
WEIGHTED = (np.array(SAMPLES)[:, None] * TARGETS).sum(0) / sum(SAMPLES)
PLAIN = TARGETS.mean(0)
SEPARATION = float(np.linalg.norm(WEIGHTED - PLAIN))


def train(steps: int, lr: float = 0.02, samples=None, inner=torch.optim.SGD, average=True,
          weights_too=False, **sgp):
    """Rank i's quadratic from z = 0; the averaged (or own) z, and the weights' sum per step.
    (The average's distance to the optimum is of the order of lr: the ranks' models differ
    by the consensus error, more with Overlap SGP's stale mixing.)"""
    z = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(inner([z], lr=lr), samples_per_step=samples, **sgp)
    a = torch.tensor(TARGETS[me])
    weights = []
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * ((z - a) ** 2).sum()).backward()
        opt.step()
        if weights_too:
            weights.append(sum(hvd.allgather_object(opt.metrics()["weight"])))
    if average:
        opt.average_parameters()
    return z.detach().numpy().copy(), weights, opt


VARIANTS = {
    "SGP": dict(),
    "SGP on a random directed graph (the weights move)": dict(topology="random"),
    "Overlap SGP": dict(overlap=True),
    "Local SGD H=4 over gossip": dict(local_steps=4, outer_optimizer="sgd:1"),
    "DiLoCo-style heavy ball H=4 over gossip": dict(local_steps=4,
                                                    outer_optimizer="heavyball:0.5:0.5"),
    "2 streamed fragments H=4": dict(local_steps=4, outer_optimizer="sgd:1",
                                     outer_fragments=2),
    "AllReduce SGD": dict(mode="allreduce"),
    "Local SGD H=4 over AllReduce": dict(mode="allreduce", local_steps=4),
}


@checks
def check_every_exchange_ends_at_the_sample_weighted_optimum():
    """300 steps leave e^(-0.02 * 300) = 0.25% of the start; the rest is the consensus error
    of the order of lr, which more steps do not shrink (at 4 ranks, 1000 steps left the same
    distances within 0.005, Overlap SGP's timing aside)."""
    for name, sgp in VARIANTS.items():
        weighted, _, _ = train(300, samples=SAMPLES[me], **sgp)
        plain, _, _ = train(300, **sgp)
        off, off_plain = (float(np.linalg.norm(weighted - WEIGHTED)),
                          float(np.linalg.norm(plain - PLAIN)))
        checks.verify(f"{name}: |z - weighted optimum| = {off:.4f}, without samples_per_step "
                      f"|z - plain mean| = {off_plain:.4f} (the two optima {SEPARATION:.2f} "
                      "apart)", off < 0.05 * SEPARATION and off_plain < 0.05 * SEPARATION)
    return None


@checks
def check_the_pushsum_weights_still_sum_to_n():
    worst = 0.0
    for sgp in (dict(), dict(local_steps=4, outer_optimizer="sgd:1")):
        _, weights, _ = train(60, samples=SAMPLES[me], average=False, weights_too=True,
                            topology="random", **sgp)
        worst = max(worst, max(abs(w - hvd.size()) for w in weights))
    assert worst < 1e-12, worst
    return (f"on a random directed graph the PushSum weights sum to n at every step (largest "
            f"error {worst:.1e})")


@checks
def check_equal_samples_change_nothing():
    for name, sgp in VARIANTS.items():
        if sgp.get("overlap"):  # (a message is summed in whenever it has arrived: not
            continue  # deterministic, with or without the option)
        same, _, _ = train(40, samples=16, average=False, **sgp)
        without, _, _ = train(40, average=False, **sgp)
        assert np.array_equal(same, without), (name, same - without)
    return ("equal samples_per_step on every rank: the trajectories equal those without it, "
            "bit for bit (every variant but Overlap SGP, whose arrivals are timed by the run)")


@checks
def check_adam_updates_are_weighted_too():
    """Adam's step does not scale with the gradient: the update is what is weighted."""
    weighted, _, _ = train(600, lr=0.01, samples=SAMPLES[me], inner=torch.optim.Adam)
    plain, _, _ = train(600, lr=0.01, inner=torch.optim.Adam)
    to_weighted = float(np.linalg.norm(weighted - WEIGHTED))
    to_plain = float(np.linalg.norm(plain - WEIGHTED))
    checks.verify(f"Adam: |z - weighted optimum| {to_weighted:.3f} with samples_per_step, "
                  f"{to_plain:.3f} without", to_weighted < 0.5 * to_plain)
    return None


@checks
def check_a_joined_rank_leaves_the_others_weighted_mean():
    """AllReduce SGD with the last rank joined early: the others' gradients are averaged by
    their samples only (the joined rank's share of the sum is 0)."""
    z = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([z], lr=0.05), samples_per_step=SAMPLES[me],
                                   mode="allreduce")
    a = torch.tensor(TARGETS[me])
    steps = 0 if me == n - 1 else 3
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * ((z - a) ** 2).sum()).backward()
        opt.step()
    hvd.join()
    b = np.array(SAMPLES[:-1])[:, None]
    mean = (b * TARGETS[:-1]).sum(0) / b.sum()  # each step: z <- z - lr (z - mean)
    off = float(np.linalg.norm(z.detach().numpy() - mean * (1 - 0.95 ** steps)))
    checks.verify(f"rank {n - 1} joined at once: the others' 3 steps follow their own "
                  f"sample-weighted mean gradient exactly ({off:.1e} off)",
                  me == n - 1 or off < 1e-12)
    return None


@checks
def check_bad_input_fails_on_every_rank():
    expect_error(OptionError, lambda: train(1, samples=0))
    error = expect_error(ConsistencyError, lambda: train(1, samples=4 if me != 1 else None))
    assert "samples_per_step" in str(error) or "options" in str(error), error
    return f"samples_per_step=0 and a rank without it fail on every rank: {str(error)[:120]}"


checks.run()
