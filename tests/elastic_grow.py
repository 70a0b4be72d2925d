"""Growing back (``sgprun --fault-tolerant --max-np N``) on real processes, and repairs
without a replacement around ``hvd.join()``; run by test_elastic.py.

An elastic training function in Horovod's idiom (hvd.elastic.run, TorchState, a commit per
step). ``--kill ORIGIN:STEP`` makes the process launched as rank ORIGIN die at that step
(os._exit(1) for the first, SIGKILL after: see elastic_checks.py), or just before the
``hvd.join()`` that ``--join-every K`` puts after every K steps (``--kill-in-join``, so that
the replacement's first use of the optimizer is a join()), or ``--freeze ORIGIN:STEP`` makes it
stop itself (SIGSTOP, never resumed: found by a peer on its machine, stopped.py); the survivors
repair, spawn a replacement (or call up a warm spare: ``sgprun --spares``; ``--spares-die``
makes every spare kill or stop itself first), which runs this same script from the top and
joins at the survivors' ``state.sync()``. Every (re)entry of the training function checks
what the join promises: every rank holds rank 0's parameters and PushSum weight 1, so the
weights sum to the world's size. With ``--lr-zero`` (pure mixing) the de-biased average is
conserved from there to the end: the replacement added no mass and none was counted twice.
Rank 0 prints the figures; a broken promise raises on every rank.
"""
import argparse
import os
import signal
import sys
import time

from hvd_sgp.common import runtime, spares

if spares.waiting() and "--spares-die" in sys.argv:  # a warm spare dies before it is needed
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[
        sys.argv[sys.argv.index("--spares-die") + 1]])

import torch  # noqa: E402

import hvd_sgp.torch as hvd  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--np", type=int, required=True, help="ranks at launch")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--until-whole", action="store_true", help="after --steps, go on (a step "
                    "every 0.05 s) until a step on --np ranks: a replacement joins at the "
                    "first commit at which it is ready, which may come after --steps")
parser.add_argument("--kill", action="append", default=[], metavar="ORIGIN:STEP")
parser.add_argument("--lr-zero", action="store_true")
parser.add_argument("--overlap", action="store_true")
parser.add_argument("--join-every", type=int, default=0, metavar="K")
parser.add_argument("--kill-in-join", action="append", default=[], metavar="ORIGIN:STEP")
parser.add_argument("--freeze", action="append", default=[], metavar="ORIGIN:STEP")
parser.add_argument("--spares-die", choices=("kill", "stop"), help="every warm spare (sgprun "
                    "--spares) kills or stops itself (SIGKILL, SIGSTOP) as it starts")
args = parser.parse_args()
kills = {tuple(int(x) for x in item.split(":")) for item in args.kill}
kills_in_join = {tuple(int(x) for x in item.split(":")) for item in args.kill_in_join}
freezes = {tuple(int(x) for x in item.split(":")) for item in args.freeze}

began = time.time()
hvd.init()
torch.set_num_threads(1)
origin = runtime.origin_rank()
replacement = origin >= args.np
if replacement:
    print(f"grow: replacement origin {origin} started at {began:.3f}, joined as rank "
          f"{hvd.rank()} of {hvd.size()} (local {hvd.local_rank()}/{hvd.local_size()}) at "
          f"{time.time():.3f}", flush=True)

torch.manual_seed(origin)  # different models: mixing has work to do, and a missed sync shows
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.0 if args.lr_zero else 0.01),
    named_parameters=model.named_parameters(), overlap=args.overlap or None,
    max_delay=2 if args.overlap else None)
state = hvd.elastic.TorchState(model, optimizer, step=0, joined=0)
entries = []  # (step, world size, sum of z) at each entry of the training function


def params() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def weight() -> float:
    return float(optimizer.metrics()["weight"])


def die() -> None:
    print(f"grow: origin {origin} dies at step {state.step} at {time.time():.3f}", flush=True)
    if (origin, state.step) != min(kills | kills_in_join, key=lambda kill: kill[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"grow check failed on rank {hvd.rank()} (origin {origin}): {what}")


def world_average() -> torch.Tensor:
    """The world's de-biased average, sum of w z over sum of w (nothing is in flight between
    two steps of SGP without overlap)."""
    w = weight()
    mass = torch.cat([w * params().double(), torch.tensor([w], dtype=torch.float64)])
    total = hvd.allreduce(mass, op=hvd.Sum, name="grow.average")
    return total[:-1] / total[-1]


averages = []  # the world's de-biased average at the last commit since this entry, if any


@hvd.elastic.run
def train(state):
    z = params()
    spread = float((hvd.allreduce(z, op=hvd.Max) - hvd.allreduce(z, op=hvd.Min)).abs().max())
    weights = float(hvd.allreduce(torch.tensor([weight()], dtype=torch.float64), op=hvd.Sum))
    if entries and hvd.size() > entries[-1][1] and averages:  # a take-in: nothing lost
        gap = float((z.double() - averages[-1]).abs().max())
        expect(gap < 1e-6, f"the take-in changed the de-biased average by {gap}")
    averages.clear()
    entries.append((state.step, hvd.size(), float(z.double().sum())))
    if hvd.rank() == 0:
        print(f"grow: entry at step {state.step} on {hvd.size()} ranks: parameters spread "
              f"{spread:.1e}, weights sum {weights:g}", flush=True)
    expect(spread < 1e-6, f"parameters differ after the sync by {spread}")
    expect(abs(weights - hvd.size()) < 1e-9, f"weights sum {weights}, not {hvd.size()}")
    joined = len(entries) > 1 or replacement
    gen = torch.Generator().manual_seed(1000 * origin + state.step)
    while state.step < args.steps or (args.until_whole and (
            hvd.size() < args.np or entries[-1][0] == state.step)):  # (a step on all, then)
        if state.step >= args.steps:
            time.sleep(0.05)
        if args.join_every and state.step % args.join_every == 0 and state.joined < state.step:
            if (origin, state.step) in kills_in_join:
                die()
            hvd.join()  # (every rank has as many steps: nobody is served, all must get here)
            state.joined = state.step
            state.commit()
        if (origin, state.step) in kills:
            die()
        if (origin, state.step) in freezes:
            print(f"grow: origin {origin} stops at step {state.step} at {time.time():.3f}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
        state.step += 1
        if joined:
            joined = False
            print(f"grow: rank {hvd.rank()} (origin {origin}) completed step {state.step} on "
                  f"{hvd.size()} ranks at {time.time():.3f}", flush=True)
        if not args.overlap:
            averages[:] = [world_average()]
        state.commit()


train(state)
optimizer.synchronize_gossip()
w = weight()
mass = hvd.allreduce(torch.tensor([w * float(params().double().sum()), w],
                                  dtype=torch.float64), op=hvd.Sum)
origins = hvd.allgather_object(origin)
nodes = hvd.allgather_object((hvd.local_rank(), hvd.local_size(), hvd.cross_rank()))
step, size, z_sum = entries[-1]
expect(abs(float(mass[1]) - hvd.size()) < 1e-9, f"final weights sum {float(mass[1])}")
if args.lr_zero:  # pure mixing from the last join: sum of w z is size x that entry's average
    expect(abs(float(mass[0]) - size * z_sum) < 1e-6 * max(1.0, abs(size * z_sum)),
           f"mass {float(mass[0])} against {size * z_sum} at the join")
if hvd.rank() == 0:
    print(f"grow: finished on {hvd.size()} ranks, origins by rank {origins}, nodes {nodes}, "
          f"sum of weights {float(mass[1]):g}, sum of w z {float(mass[0]):.6f} "
          f"(at the last entry {size} x {z_sum:.6f})", flush=True)
    print(f"grow checks passed on {hvd.size()} ranks", flush=True)
