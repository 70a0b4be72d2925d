"""Checks of hvd_sgp.torch on real MPI processes; run by test_torch.py on n ranks.

Each check prints "ok <name>" on rank 0; a failure raises and ends the job non-zero.
"""
import copy
import gc
import math
import warnings
import weakref

import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common.errors import ConsistencyError, ScheduleError, SgpValueError
from mpi_checks import Checks, expect_error

hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
checks = Checks("torch", hvd.rank, hvd.size, hvd.barrier)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def mlp(seed, width=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


@checks
def check_collectives():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + me
    assert torch.allclose(hvd.allreduce(t), torch.arange(6.).reshape(2, 3) + (n - 1) / 2)
    assert torch.allclose(hvd.allreduce(t, op=hvd.Sum), (torch.arange(6.).reshape(2, 3) * n + n * (n - 1) / 2))
    assert hvd.allreduce(torch.tensor([me]), op=hvd.Max).item() == n - 1
    assert hvd.allreduce(torch.tensor([me + 1.0]), op=hvd.Min).item() == 1
    assert hvd.allreduce(torch.tensor([2.0]), op=hvd.Product).item() == 2.0 ** n
    assert torch.allclose(hvd.allreduce(t, prescale_factor=2.0, postscale_factor=0.5), hvd.allreduce(t))
    s = torch.ones(3) * me
    hvd.allreduce_(s, op=hvd.Sum)
    assert torch.allclose(s, torch.full((3,), n * (n - 1) / 2))
    h = hvd.allreduce_async(torch.ones(2))
    assert torch.allclose(hvd.synchronize(h), torch.ones(2))
    half = hvd.allreduce(torch.ones(4, dtype=torch.float16) * me, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float16 and float(half[0]) == (n - 1) / 2
    g = hvd.allgather(torch.full((me + 1, 2), float(me)))
    assert g.shape == (n * (n + 1) // 2, 2) and g[-1, 0] == n - 1
    b = hvd.broadcast(torch.full((3,), float(me)), root_rank=n - 1)
    assert torch.equal(b, torch.full((3,), float(n - 1)))
    c = torch.full((3,), float(me))
    hvd.broadcast_(c, root_rank=0)
    assert torch.equal(c, torch.zeros(3))
    scalar = torch.tensor(float(me) + 1)  # 0-d, like BatchNorm's num_batches_tracked
    hvd.broadcast_(scalar, root_rank=0)
    assert scalar.shape == () and scalar.item() == 1.0
    splits = torch.tensor([1] * n)
    out, received = hvd.alltoall(torch.arange(n, dtype=torch.float32) + 10 * me, splits=splits)
    assert torch.equal(out, torch.tensor([10.0 * r + me for r in range(n)]))
    assert received.tolist() == [1] * n
    rs = hvd.reducescatter(torch.ones(2 * n, 2) * me, op=hvd.Sum)
    assert rs.shape == (2, 2) and float(rs[0, 0]) == n * (n - 1) / 2
    assert hvd.broadcast_object({"rank": me}, root_rank=0) == {"rank": 0}
    assert hvd.allgather_object(me) == list(range(n))
    out = hvd.grouped_allreduce([torch.ones(2) * me, torch.ones(1)])
    assert torch.allclose(out[0], torch.full((2,), (n - 1) / 2))
    assert 0 <= hvd.join() < n
    expect_error(ValueError, lambda: hvd.allreduce(t, op=hvd.Adasum), rank=me,
                 fragments=("Adasum",))
    checks.ok("collectives")


@checks
def check_broadcast_optimizer_state():
    kinds = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.Adam, dict(lr=0.01)),
             (torch.optim.AdamW, dict(lr=0.01)), (torch.optim.Adagrad, dict(lr=0.1)),
             (torch.optim.Adadelta, dict()), (torch.optim.Adamax, dict()),
             (torch.optim.ASGD, dict()), (torch.optim.NAdam, dict()), (torch.optim.RAdam, dict()),
             (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)), (torch.optim.Rprop, dict())]
    for cls, kw in kinds:
        model = mlp(me)
        opt = cls(model.parameters(), **kw)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        if me == 0:
            for g in opt.param_groups:
                g["lr"] = 0.123
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        mine = [v for s in state["state"].values() for v in s.values()]
        roots = hvd.broadcast_object(mine, root_rank=0)
        for a, b in zip(mine, roots):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), cls
            else:
                assert a == b, cls
        assert opt.param_groups[0]["lr"] == 0.123, cls
        assert torch.equal(flat(model), hvd.broadcast(flat(model), 0))
    checks.ok(f"broadcast_optimizer_state for {len(kinds)} optimizers")


@checks
def check_named_parameters():
    model = mlp(0)
    named = list(model.named_parameters())
    for bad, message in ((named + [named[0]], "unique"), (named[1:], "not named"),
                         ([p for _, p in named], "tuples")):
        expect_error(ValueError, lambda: hvd.DistributedOptimizer(  # Horovod's messages
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=bad),
            fragments=(message,))
    hvd.DistributedOptimizer(torch.optim.SGD(mlp(0).parameters(), lr=0.1))  # absent is fine
    checks.ok("named_parameters duplicates / missing / malformed / absent")


def train_steps(opt, model, steps, seed, clip=None, twice=False):
    gen = torch.Generator().manual_seed(seed + me)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        y = torch.randn(8, 1, generator=gen)
        opt.zero_grad()
        out = model(x)
        if twice:
            out = out + model(x * 0.5)
        torch.nn.functional.mse_loss(out, y).backward()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


@checks
def check_complete_equals_allreduce():
    results = {}
    for mode, topology in (("sgp", "complete"), ("allreduce", None)):
        model = mlp(1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
            named_parameters=model.named_parameters(), topology=topology, mode=mode)
        train_steps(opt, model, 20, seed=3)
        results[mode] = flat(model)
    diff = (results["sgp"] - results["allreduce"]).abs().max().item()
    assert diff < 1e-5, diff
    checks.ok(f"complete-graph SGP equals AllReduce SGD with momentum over 20 steps ({diff:.1e})")


@checks
def check_pure_mixing():
    model = mlp(100 + me)
    target = hvd.allreduce(flat(model))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    steps = int(math.log2(n)) if n & (n - 1) == 0 else 0
    train_steps(opt, model, steps, seed=0)
    if steps:
        err = (flat(model) - target).abs().max().item()
        assert err < 1e-6, err
        checks.ok(f"lr=0 reaches the exact average in log2(n)={steps} steps")


@checks
def check_regression():
    true_w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    noise = 0.1
    topologies = ["exponential", "ring", "complete", "random"] + (["bipartite"] if n % 2 == 0 else [])
    for topology in topologies:
        torch.manual_seed(7 + me)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       topology=topology)
        gen = torch.Generator().manual_seed(11 + me)
        for step in range(300):
            x = torch.randn(16, 4, generator=gen)
            y = x @ true_w + noise * torch.randn(16, 1, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        x = torch.randn(2000, 4, generator=gen)
        y = x @ true_w + noise * torch.randn(2000, 1, generator=gen)
        mse = torch.nn.functional.mse_loss(model(x), y).item()
        assert mse < 1.5 * noise ** 2, (topology, mse)
    checks.ok(f"linear regression MSE < 1.5 noise^2 on {topologies}")


@checks
def check_horovod_behaviours():
    # clipping between synchronize() and step(), inside skip_synchronize()
    model = mlp(2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(opt, model, 3, seed=1, clip=0.5)
    # the step warning
    model(torch.randn(2, 4)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    # backward_passes_per_step
    model = mlp(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   backward_passes_per_step=2)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()

    def three_passes():
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()

    expect_error(AssertionError, three_passes, fragments=("backward_passes_per_step",))
    opt.set_backward_passes_per_step(3)
    # a layer used twice per step, and a parameter that toggles requires_grad
    model = mlp(4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train_steps(opt, model, 2, seed=2, twice=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    frozen = model[0].weight.detach().clone()
    model[0].weight.requires_grad_(False)
    train_steps(opt, model, 2, seed=3)  # a frozen parameter is mixed, not stepped
    assert torch.allclose(model[0].weight, frozen, atol=1e-6)
    model[0].weight.requires_grad_(True)
    train_steps(opt, model, 2, seed=4)
    assert not torch.equal(model[0].weight, frozen)
    # compression: training still reaches the same neighbourhood
    finals = {}
    for name, comp in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                       ("bf16", hvd.Compression.bf16)):
        model = mlp(5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       compression=comp)
        train_steps(opt, model, 10, seed=5)
        finals[name] = flat(model)
    assert (finals["fp16"] - finals["none"]).abs().max() < 5e-3
    assert (finals["bf16"] - finals["none"]).abs().max() < 5e-2
    checks.ok("clipping with synchronize, step warning, backward_passes_per_step, shared layer, "
       "requires_grad toggling, fp16/bf16 compression")


@checks
def check_gradients_are_views_of_the_reduced_buffer():
    """Reduced gradients come back as views of the flat gradient buffer (no copy back), and
    with zero_grad(set_to_none=False) backward accumulates into that buffer: the averages
    stay exact either way, step after step."""
    model = mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   mode="allreduce")
    gen = torch.Generator().manual_seed(60 + me)
    for set_to_none in (True, False, False, True):
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)),
                                     torch.randn(8, 1, generator=gen)).backward()
        local = [p.grad.detach().clone() for p in model.parameters()]
        expected = [hvd.allreduce(g, op=hvd.Average, name=f"view.{i}")
                    for i, g in enumerate(local)]
        opt.synchronize()
        flat_grads = opt._groups[0].grad
        for p, want in zip(model.parameters(), expected):
            start = p.grad.data_ptr() - flat_grads.data_ptr()
            assert n == 1 or 0 <= start < flat_grads.numel() * flat_grads.element_size(), \
                "the reduced gradient is not a view of the flat buffer"  # (1 rank: no sum)
            assert torch.allclose(p.grad, want, atol=1e-6), (p.grad - want).abs().max()
        with opt.skip_synchronize():
            opt.step()
    checks.ok("reduced gradients are views of the flat buffer, exact with set_to_none on/off")


class TwoBranches(torch.nn.Module):
    """The ``spare`` branch is used on even steps only: a parameter that some steps leave
    without a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.main, self.spare = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x, step):
        h = torch.tanh(self.main(x))
        return self.head(h) + (self.spare(h) if step % 2 == 0 else 0)


@checks
def check_zero_grad_keeps_views_same_trajectory():
    """zero_grad() (torch's default set_to_none=True) keeps the reduced gradients as zeroed
    views of the flat buffer, and the training is the same, bit for bit, as with the fresh
    gradient tensors that dropping every gradient (torch's own zero_grad) gives: with Adam and
    weight decay, over steps where a branch gets no gradient (its grad is None at the step, so
    Adam leaves it alone, as after torch's zero_grad), with two backward passes per step."""
    layouts = ("allreduce", "sgp")
    for mode in layouts:
        runs = []
        for keep in (True, False):
            model = TwoBranches()
            opt = hvd.DistributedOptimizer(
                torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1),
                named_parameters=model.named_parameters(), mode=mode,
                backward_passes_per_step=2)
            gen = torch.Generator().manual_seed(80 + me)
            states, grads = [], []
            for step in range(6):
                if keep:
                    opt.zero_grad()
                else:
                    for p in model.parameters():
                        p.grad = None
                for _ in range(2):
                    torch.nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen), step),
                                                 torch.randn(8, 1, generator=gen)).backward()
                before = model.spare.weight.detach().clone()
                opt.step()
                if step % 2 == 1:  # no gradient reached the spare branch: Adam skipped it
                    assert model.spare.weight.grad is None, (mode, keep, step)
                    assert mode != "allreduce" or torch.equal(model.spare.weight, before), \
                        (keep, step)  # (gossip would mix it)
                states.append(flat(model).clone())
                grads.append([None if p.grad is None else p.grad.clone()
                              for p in model.parameters()])
            if keep and opt._groups[0]._grad is not None:  # the reduced steps kept the views
                opt.zero_grad()
                buffer = opt._groups[0].grad
                start = model.main.weight.grad.data_ptr() - buffer.data_ptr()
                assert 0 <= start < buffer.numel() * buffer.element_size(), mode
                assert not model.main.weight.grad.any()  # zeroed in place
                assert model.spare.weight.grad is None  # dropped at the last step: stays None
            runs.append((states, grads))
            opt.synchronize_gossip()
        (kept_states, kept_grads), (fresh_states, fresh_grads) = runs
        for step, (a, b) in enumerate(zip(kept_states, fresh_states)):
            assert torch.equal(a, b), (mode, step, (a - b).abs().max())
        for a, b in zip(kept_grads, fresh_grads):
            assert [g is None for g in a] == [g is None for g in b], mode
            assert all(x is None or torch.equal(x, y) for x, y in zip(a, b)), mode
    checks.ok("zero_grad keeps the gradient views; parameters step by step identical to fresh "
              f"gradients ({', '.join(layouts)}; Adam with weight decay, unused branch skipped)")


@checks
def check_state_dict_and_consensus():
    model = mlp(6 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   topology=hvd_irregular() if hvd.cross_size() >= 3 else None)
    train_steps(opt, model, 5, seed=6)
    state = copy.deepcopy(opt.state_dict())  # as torch.save would: a snapshot
    assert state["hvd_sgp"]["iteration"] == 5
    params = flat(model).clone()
    train_steps(opt, model, 3, seed=7)
    after = flat(model).clone()
    with torch.no_grad():  # in place: the parameters live in hvd_sgp's flat buffer
        offset = 0
        for p in model.parameters():
            p.copy_(params[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    opt.load_state_dict(state)
    train_steps(opt, model, 3, seed=7)
    assert torch.allclose(flat(model), after, atol=1e-6), (flat(model) - after).abs().max()
    opt.average_parameters()
    assert torch.allclose(flat(model), hvd.broadcast(flat(model), 0), atol=1e-6)
    metrics = opt.metrics()
    assert metrics["iteration"] == 8 and (n == 1 or metrics["bytes_sent"] > 0)
    checks.ok("state_dict resumes exactly; average_parameters gives consensus; metrics")


def hvd_irregular():
    from hvd_sgp.common.topology import CustomGraph
    nodes = hvd.cross_size()
    return CustomGraph(nodes, [[[j for j in range(nodes) if j != i] if i == 0
                                else [(i + 1) % nodes] for i in range(nodes)]])


@checks
def check_mismatch_detected():
    width = 8 if me == 0 else 9

    def wrap():
        hvd.DistributedOptimizer(torch.optim.SGD(mlp(0, width=width).parameters(), lr=0.1))

    if n > 1:
        expect_error(ConsistencyError, wrap, rank=me)
    else:
        wrap()
    checks.ok("mismatched parameter shapes raise on every rank")


@checks
def check_overlap_schedules_and_modes():
    true_w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for kwargs in (dict(overlap=True, max_delay=1), dict(overlap=True, max_delay=2),
                   dict(mode="dpsgd") if n % 2 == 0 or n == 1 else dict(mode="sgp")):
        torch.manual_seed(7 + me)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), **kwargs)
        gen = torch.Generator().manual_seed(11 + me)
        for step in range(300):
            x = torch.randn(16, 4, generator=gen)
            y = x @ true_w + 0.1 * torch.randn(16, 1, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.synchronize_gossip()
        err = (model.weight.detach().T - true_w).abs().max().item()
        assert err < 0.05, (kwargs, err)
    # hybrid schedule: identical parameters in AllReduce stages, gossip in between
    model = mlp(20 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   schedule="0:allreduce,5s:sgp2,10s:osgp1,15s:allreduce")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    modes = []
    for step in range(20):
        train_steps(opt, model, 1, seed=30 + step)
        modes.append(opt.metrics()["mode"] + ("+overlap" if opt.metrics()["overlap"] else ""))
        if step in (4, 19):
            assert torch.equal(flat(model), hvd.broadcast(flat(model), 0)), step
    assert modes[0] == "allreduce" and modes[7] == "sgp" and modes[12] == "sgp+overlap", modes
    expect_error(ScheduleError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(mlp(0).parameters(), lr=0.1), schedule="0:allreduce,ten:sgp"), rank=me)
    checks.ok("overlap tau=1,2 and dpsgd converge; schedule switches keep ranks consistent")


@checks
def check_placements():
    """The mixer on torch tensors (the CUDA-aware path's code, MPI reading tensors through
    DLPack) and through a staging copy (the path without CUDA-aware MPI) train exactly like the
    numpy view, here on CPU tensors: every branch except the CUDA streams themselves."""
    from hvd_sgp.torch import flat as flat_module

    irregular = hvd_irregular() if hvd.cross_size() >= 3 else None
    configs = {"exponential": {}, "irregular, weight tracked": dict(topology=irregular),
               "fp16 wire": dict(compression=hvd.Compression.fp16, topology=irregular),
               "bf16 wire": dict(compression=hvd.Compression.bf16, peers=2),
               "allreduce": dict(mode="allreduce")}
    chosen = flat_module.placement
    results = {}
    try:
        for where in flat_module.PLACEMENTS:
            flat_module.placement = lambda device, where=where: where
            for name, kwargs in configs.items():
                model = mlp(40 + hvd.cross_rank())
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **kwargs)
                assert opt._groups[0].placement == where
                train_steps(opt, model, 6, seed=41)
                results[where, name] = (flat(model).clone(), opt.state_dict()["hvd_sgp"])
            # Overlap SGP: arrival order varies, but pure mixing conserves the network average
            model = mlp(50 + hvd.cross_rank())  # a node starts as one
            start = hvd.allreduce(flat(model))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                           overlap=True, max_delay=2)
            train_steps(opt, model, 8, seed=0)
            opt.average_parameters()
            err = (flat(model) - start).abs().max().item()
            assert err < 1e-5, (where, err)
    finally:
        flat_module.placement = chosen
    worst = 0.0
    for (where, name), (params, state) in results.items():
        reference, reference_state = results["view", name]
        worst = max(worst, (params - reference).abs().max().item())
        assert torch.allclose(params, reference, rtol=0, atol=1e-6), (where, name)
        assert state["iteration"] == reference_state["iteration"]
        assert max(abs(a - b) for a, b in zip(state["weights"], reference_state["weights"])) \
            < 1e-6, (where, name)
    checks.ok(f"mixing on tensors (direct) and through staging equals the numpy view ({worst:.1e})")


@checks
def check_schedule_on_every_placement():
    """A schedule switch into AllReduce SGD (after synchronous SGP, and after Overlap SGP with
    messages in flight to drain) averages parameters and momentum on every placement: on the
    staged one the average must land in the parameters, not in a host copy that the next
    step overwrites. Then every rank holds the same model at every AllReduce step."""
    from hvd_sgp.torch import flat as flat_module

    chosen = flat_module.placement
    models = {}
    try:
        for where in ("view", "staged"):
            flat_module.placement = lambda device, where=where: where
            for schedule in ("0:sgp,3s:allreduce", "0:osgp1,3s:allreduce"):
                model = mlp(60 + me)
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                    schedule=schedule)
                assert opt._groups[0].placement == where
                for step in range(6):
                    train_steps(opt, model, 1, seed=70 + step)
                    if step >= 3:
                        assert torch.equal(flat(model), hvd.broadcast(flat(model), 0)), \
                            (where, schedule, step)
                models[where, schedule] = flat(model).clone()
    finally:
        flat_module.placement = chosen
    # synchronous SGP is deterministic: the staged run equals the view; Overlap SGP's arrival
    # order is not, so there only the identity across ranks (above) is asserted
    schedule = "0:sgp,3s:allreduce"
    assert torch.allclose(models["staged", schedule], models["view", schedule], rtol=0,
                          atol=1e-6)
    checks.ok("a schedule into AllReduce averages the model on the view and staged placements")


@checks.when(hasattr(torch.amp, "GradScaler"))  # on the CPU from torch 2.3 on
def check_mixed_precision():
    """torch.amp with node 0 overflowing at step 2, in Horovod's recipe (synchronize,
    unscale_, skip_synchronize + scaler.step: only rank 0 overflows, the in-node average
    spreads it) and with a plain scaler.step (every rank of node 0 overflows: the check then
    sees only local gradients): node 0 skips its local update but still gossips, so nobody
    waits for it; its loss scale halves on every one of its ranks; the others keep theirs."""
    for recipe in ("horovod", "plain"):
        overflowing = me == 0 if recipe == "horovod" else hvd.cross_rank() == 0
        model = mlp(80 + hvd.cross_rank())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        gen = torch.Generator().manual_seed(81 + me)
        for step in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)),
                                                torch.randn(8, 1, generator=gen))
            if step == 2 and overflowing:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if recipe == "horovod":
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
        assert opt.metrics()["iteration"] == 5, (recipe, opt.metrics())
        assert torch.isfinite(flat(model)).all(), recipe
        scales = hvd.allgather_object((hvd.cross_rank(), scaler.get_scale()))
        for node, scale in scales:
            assert scale == (2.0 ** 15 if node == 0 else 2.0 ** 16), (recipe, scales)
    return "GradScaler: an overflowing node skips its update, gossips on, scale agreed in-node"


@checks.when(n >= 2)
def check_process_set_optimizer():
    """DistributedOptimizer(process_set=...): it trains over the set's ranks only (here each
    half its own model, exactly averaged with mode='allreduce', gossiped by default), and a
    rank outside the set trains alone, as under Horovod."""
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    sets = hvd.add_process_set(evens), hvd.add_process_set(odds)
    mine = sets[me % 2]
    try:
        for mode in ("allreduce", "sgp"):
            model = mlp(70)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           process_set=mine, mode=mode, topology="complete")
            train_steps(opt, model, 3, seed=71)
            mine_models = hvd.allgather(flat(model)[None], process_set=mine)
            assert all(torch.allclose(m, mine_models[0], atol=1e-6) for m in mine_models), mode
            everyone = hvd.allgather(flat(model)[None])
            assert n < 2 or not torch.allclose(everyone[0], everyone[1]), mode
            assert opt.metrics()["iteration"] == 3
        model = mlp(72)  # ranks outside the set step alone
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       process_set=sets[0], mode="allreduce")
        train_steps(opt, model, 2, seed=73)
        everyone = hvd.allgather(flat(model)[None])
        odd = [everyone[r] for r in odds]
        assert all(not torch.allclose(odd[0], other) for other in odd[1:])
    finally:
        hvd.remove_process_set(sets[1])
        hvd.remove_process_set(sets[0])
    return "process_set=: each set trains its own model; ranks outside train alone"


class HalfCompressor:
    """A script's own compressor in Horovod's interface (not one of hvd.Compression's)."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


@checks
def check_custom_compressor():
    """A Horovod Compressor of the script's own is the gossip codec: the same rounding as the
    built-in fp16 wire, so the same models; a non-compressor is refused on every rank."""
    models = {}
    for name, compression in {"custom": HalfCompressor, "fp16": hvd.Compression.fp16}.items():
        model = mlp(60 + hvd.cross_rank())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       compression=compression)
        train_steps(opt, model, 4, seed=61)
        models[name] = flat(model)
    assert torch.equal(models["custom"], models["fp16"]), (models["custom"] - models["fp16"])
    expect_error(SgpValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(mlp(0).parameters(), lr=0.1), compression="fp16"))
    return "a script's own Horovod Compressor gossips as the fp16 wire does"


@checks
def check_batchnorm_statistics():
    """BatchNorm running statistics are not parameters, so SGP does not mix them;
    average_parameters(model) averages them exactly with the parameters."""
    torch.manual_seed(95)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                torch.nn.Linear(6, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    train_steps(opt, model, 3, seed=96)
    bn = model[1]
    mean = hvd.allreduce(bn.running_mean)
    var = hvd.allreduce(bn.running_var)
    opt.average_parameters(model)
    assert torch.allclose(bn.running_mean, mean, atol=1e-6)
    assert torch.allclose(bn.running_var, var, atol=1e-6)
    assert torch.equal(flat(model), hvd.broadcast(flat(model), 0))
    return "average_parameters(model) averages BatchNorm running statistics too"


@checks
def check_sparse_gradients():
    """Embedding(sparse=True) gradients: averaged where they must be (mode='allreduce' here,
    and in-node with several ranks per node) and handed back sparse, as Horovod's
    sparse_as_dense=True does; the model equals the same run with a dense embedding."""
    def run(sparse, optimizer, embedding_only=False, **kwargs):
        torch.manual_seed(90)
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=sparse),
                                    torch.nn.Linear(4, 1))
        if embedding_only:  # for SparseAdam, which takes sparse gradients only
            model[1] = torch.nn.Linear(4, 1).requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = hvd.DistributedOptimizer(optimizer(params), mode="allreduce", **kwargs)
        gen = torch.Generator().manual_seed(91 + me)
        for _ in range(4):
            opt.zero_grad()
            words = torch.randint(0, 20, (6, 3), generator=gen)
            torch.nn.functional.mse_loss(model(words), torch.randn(6, 1, generator=gen)).backward()
            opt.step()
        return flat(model)

    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    assert torch.allclose(run(True, sgd), run(False, sgd), atol=1e-6)
    sparse_adam = lambda params: torch.optim.SparseAdam(list(params), lr=0.01)  # noqa: E731
    assert torch.equal(run(True, sparse_adam, True, sparse_as_dense=True),
                       run(True, sparse_adam, True))
    return "sparse gradients averaged and handed back sparse (also with sparse_as_dense)"


@checks.when(hvd.local_size() > 1)
def check_node_groups_in_a_user_world():
    """A script that started torch.distributed itself: the in-node group hvd_sgp carves out of
    its world holds exactly this node's ranks (gloo here; NCCL on GPUs)."""
    import torch.distributed as dist
    from hvd_sgp.torch import node_nccl

    port = hvd.broadcast_object(node_nccl._free_port() if me == 0 else None, root_rank=0)
    store = dist.TCPStore("127.0.0.1", port, n, me == 0)
    dist.init_process_group("gloo", store=store, rank=n - 1 - me, world_size=n)  # reversed
    try:
        group = node_nccl._user_world_subgroup(backend="gloo")
        value = torch.tensor([float(me)])
        dist.all_reduce(value, group=group)
        first = me - hvd.local_rank()
        assert value.item() == sum(range(first, first + hvd.local_size())), value
    finally:
        dist.destroy_process_group()
    checks.ok("in-node groups carved from a user's torch.distributed world hold the node's ranks")


@checks
def check_a_collected_optimizer_closes_between_mpi_calls():
    """An optimizer dropped in a reference cycle goes when the cycle collector runs, and that
    may be inside an mpi4py call, where freeing its communicator deadlocked the rank on
    mpi4py's own lock (finalizers.py): the collection only queues the close, and the next step
    of any optimizer runs it."""
    def dropped():
        model = mlp(0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        train_steps(opt, model, 2, seed=3)
        opt.cycle = opt  # only the cycle collector frees it
        return weakref.ref(opt._sgp_session())
    session = dropped()
    gc.collect()
    queued = session() is not None and not session().closed
    model = mlp(1)
    train_steps(hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05)), model,
                1, seed=3)
    assert queued and (session() is None or session().closed), (queued, session())
    checks.ok("a collected optimizer is closed at the next step, not inside the collection")


checks.run()
