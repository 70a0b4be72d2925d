"""Communication-reduced SGP on real MPI processes; run by test_compression.py.

Compressed PushSum (int8, top-k, random-k; error feedback on and off; synchronous and Overlap
SGP) conserves the network average and trains; bytes on the wire shrink as the codecs say;
the simulator computes what MPI computes; HVD_SGP_COMPRESSION applies only where the script
asks for no compression; bad input fails at construction on every rank; local steps and
SlowMo communicate when they should and resume exactly from a checkpoint. The Keras check
(``check_keras``) imports TensorFlow, so the test runs it in a launch of its own.
"""
import copy
import os
import sys

import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common.errors import OptionError
from mpi_checks import Checks, expect_error

hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
checks = Checks("compression", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
CODECS = {"int8": hvd.Compression.int8, "int8:stochastic": hvd.Compression.int8("stochastic"),
          "topk:0.1": hvd.Compression.topk(0.1), "randomk:0.1": hvd.Compression.randomk(0.1)}


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def mlp(seed: int, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1))


def train(opt, model, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + me)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
        opt.step()


@checks
def check_bad_input_fails_at_construction():
    def wrap(compression=hvd.Compression.none, **sgp):
        return lambda: hvd.DistributedOptimizer(torch.optim.SGD(mlp(0).parameters(), lr=0.1),
                                                compression=compression, **sgp)

    for bad in (hvd.Compression.topk(0), hvd.Compression.topk(1.5),
                hvd.Compression.randomk(-0.1), hvd.Compression.topk("0.01:fp16"),
                hvd.Compression.int8("nearly")):
        expect_error(OptionError, wrap(bad), rank=me)
    for sgp in (dict(local_steps=0), dict(slowmo=1.5), dict(slowmo_lr=0),
                dict(consensus_step=0), dict(error_feedback="maybe")):
        expect_error(OptionError, wrap(**sgp), rank=me)
    for variable in ("zstd", "topk:2", "topk:0.01:fp16", "fp16:0.5"):
        os.environ["HVD_SGP_COMPRESSION"] = variable
        try:
            error = expect_error(OptionError, wrap(), rank=me)
        finally:
            del os.environ["HVD_SGP_COMPRESSION"]
        assert "HVD_SGP_COMPRESSION" in str(error), error  # the message names the variable
    return ("fractions outside (0, 1], top-k on an fp16 wire, unknown codecs, local_steps < 1,"
            " bad SlowMo values: OptionError at construction naming the rank")


@checks
def check_the_variable_applies_where_the_script_asks_for_none():
    def codec_of(compression=None):
        kwargs = {} if compression is None else {"compression": compression}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(mlp(0).parameters(), lr=0.1), **kwargs)
        return opt._sgp_session().settings.codec.spec

    os.environ["HVD_SGP_COMPRESSION"] = "topk:0.05"
    try:
        chosen = (codec_of(), codec_of(hvd.Compression.none), codec_of(hvd.Compression.fp16),
                  codec_of(hvd.Compression.int8))
    finally:
        del os.environ["HVD_SGP_COMPRESSION"]
    assert chosen == ("topk:0.05", "topk:0.05", "fp16", "int8"), chosen
    assert codec_of() == "none"
    return "HVD_SGP_COMPRESSION applies to Compression.none or nothing; a named codec wins"


@checks
def check_pure_mixing_conserves_the_average():
    """lr = 0: parameters change only by gossip, so the exact average (over weights: per run
    for random-k under overlap) after any number of compressed steps must be the starting
    average, for every codec, error feedback on and off, synchronous and Overlap SGP with
    tau = 1, 2."""
    worst, cases = 0.0, 0
    for spec, compression in CODECS.items():
        for feedback in (True, False):
            for overlap in ({}, dict(overlap=True, max_delay=1), dict(overlap=True,
                                                                       max_delay=2)):
                model = mlp(10 + hvd.cross_rank())  # a node starts as one
                start = hvd.allreduce(flat(model))
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                               compression=compression,
                                               error_feedback=feedback, **overlap)
                train(opt, model, 9, seed=1)
                opt.average_parameters()
                err = (flat(model) - start).abs().max().item() / start.abs().max().item()
                assert err < 1e-5, (spec, feedback, overlap, err)
                worst, cases = max(worst, err), cases + 1
    return (f"compressed pure mixing keeps the average ({worst:.1e} relative) in {cases} cases: "
            f"{len(CODECS)} codecs x error feedback on/off x SGP, OSGP tau=1, tau=2")


@checks
def check_bytes_on_the_wire():
    """Steady state (each edge's first, exact message already sent): bytes per step that the
    transport counts, against fp32."""
    if n == 1:
        return None
    torch.manual_seed(0)
    sent = {}
    for spec, compression in (("fp32", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                              ("int8", hvd.Compression.int8),
                              ("topk:0.01", hvd.Compression.topk(0.01)),
                              ("randomk:0.01", hvd.Compression.randomk(0.01))):
        model = torch.nn.Linear(200, 100)  # 20k parameters
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       compression=compression)
        for step in range(12):
            if step == 6:  # the exponential graph has at most 3 offsets here: all edges open
                before = opt.metrics()["bytes_sent"]
            opt.zero_grad()
            model(torch.randn(4, 200)).pow(2).mean().backward()
            opt.step()
        sent[spec] = (opt.metrics()["bytes_sent"] - before) / 6
    ratios = {spec: sent["fp32"] / b for spec, b in sent.items()}
    assert ratios["topk:0.01"] >= 10 and ratios["randomk:0.01"] >= 10, ratios
    assert 3.8 <= ratios["int8"] <= 4.0 and 1.95 <= ratios["fp16"] <= 2.0, ratios
    return "bytes per step vs fp32: " + ", ".join(f"{s} {r:.1f}x less" for s, r in ratios.items())


@checks
def check_compressed_training_converges():
    true_w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    results = {}
    for spec, kwargs in (("fp32", {}), ("int8", dict(compression=hvd.Compression.int8)),
                         ("topk:0.5", dict(compression=hvd.Compression.topk(0.5))),
                         ("int8:stochastic no-ef", dict(
                             compression=hvd.Compression.int8("stochastic"),
                             error_feedback=False)),
                         ("topk:0.5 no-ef", dict(compression=hvd.Compression.topk(0.5),
                                                 error_feedback=False)),
                         ("randomk:0.5 osgp2", dict(compression=hvd.Compression.randomk(0.5),
                                                    overlap=True, max_delay=2))):
        torch.manual_seed(7 + me)
        model = torch.nn.Linear(4, 1, bias=False)
        initial = (model.weight.detach().T - true_w).abs().max().item()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), **kwargs)
        gen = torch.Generator().manual_seed(11 + me)
        for _ in range(300):
            x = torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x @ true_w + 0.1 * torch.randn(
                16, 1, generator=gen)).backward()
            opt.step()
        opt.synchronize_gossip()
        results[spec] = (model.weight.detach().T - true_w).abs().max().item()
    # Without error feedback a biased codec's dropped parts stay in the copies for good (as
    # in DCD-PSGD, which needs unbiased compression): top-k trains, but to a biased point.
    biased = results.pop("topk:0.5 no-ef")
    assert max(results.values()) < 0.1 and biased < initial / 2, (results, biased, initial)
    results["topk:0.5 no-ef (biased)"] = biased
    return "compressed SGP converges on linear regression: " + ", ".join(
        f"{s} {e:.3f}" for s, e in results.items())


@checks
def check_simulator_agrees_with_mpi():
    """The same compressed mixer over MPI and in the simulator, step for step (top-k and
    int8 encode deterministically; an irregular graph moves the weights)."""
    from hvd_sgp.common import runtime
    from hvd_sgp.common.choco import ChocoMixer
    from hvd_sgp.common.pushsum import allocate
    from hvd_sgp.common.transport import PeerTransport
    from hvd_sgp.sim import SimNetwork
    from sim_checks import DIM, LR, gradient, graph, start

    if n < 4:  # sim_checks' irregular graph needs 4 nodes
        return None
    worst = 0.0
    for spec, step in (("topk:0.4", 0.5), ("int8", 1.0)):
        buffer = allocate(DIM, np.float64)
        buffer[:-1] = start(me)
        mixer = ChocoMixer(buffer, graph(n), PeerTransport(runtime.world_comm()), codec=spec,
                           step=step)
        history = []
        for k in range(12):
            buffer[:-1] -= LR * gradient(me, k, buffer[:-1])
            mixer.mix()
            history.append(np.append(buffer[:-1], mixer.weight))
        mpi = np.stack(hvd.allgather_object(np.array(history)), axis=1)
        net = SimNetwork(graph(n), DIM, codec=spec, consensus_step=step)
        for i in range(n):
            net.params[i] = start(i)
        for k in range(12):
            for i in range(n):
                net.params[i] -= LR * gradient(i, k, net.params[i])
            net.step()
            sim = np.column_stack([net.params, net.weights()])
            worst = max(worst, float(np.abs(sim - mpi[k]).max()))
        assert worst <= 1e-12, (spec, worst)
    return f"compressed mixing: simulator equals MPI step for step ({worst:.1e})"


@checks
def check_local_steps():
    """SGP with local_steps=3 gossips only at steps 3, 6, ...; AllReduce mode with
    local_steps=3 (Local SGD) holds one model on every rank after those steps only."""
    model = mlp(20 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   local_steps=3)
    sent = []
    for step in range(1, 7):
        train(opt, model, 1, seed=step)
        sent.append(opt.metrics()["bytes_sent"])
    grew = [b > a for a, b in zip([0] + sent, sent)]
    assert n == 1 or grew == [False, False, True, False, False, True], grew
    assert opt.state_dict()["hvd_sgp"]["iteration"] == 6
    model = mlp(30 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   mode="allreduce", local_steps=3)
    same = []
    for step in range(1, 7):
        train(opt, model, 1, seed=40 + step)
        models = hvd.allgather_object(flat(model))
        same.append(all(torch.equal(models[0], m) for m in models))
    assert all(same[2::3]) and (n == 1 or not any(same[:2] + same[3:5])), same
    return "local_steps=3: SGP gossips every 3rd step; Local SGD averages every 3rd step"


def snapshot_resume(kwargs: dict, steps: int = 6, more: int = 5) -> float:
    """Train ``steps``, snapshot model and optimizer, train ``more``; restore the snapshot
    and train the same ``more`` again: the largest difference between the two endings."""
    model = mlp(50 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   **kwargs)
    train(opt, model, steps, seed=60)
    state = copy.deepcopy(opt.state_dict())
    params = flat(model).clone()
    train(opt, model, more, seed=70)
    after = flat(model).clone()
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(params[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    opt.load_state_dict(state)
    train(opt, model, more, seed=70)
    return (flat(model) - after).abs().max().item()


@checks
def check_slowmo_and_checkpoints():
    """SlowMo on SGP and on Local SGD: one model on every rank after each outer step, the
    outer momentum in the checkpoint; compressed copies, random-k's run weights and SlowMo
    resume exactly."""
    model = mlp(80 + me)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   slowmo=0.5, slowmo_lr=1.0, local_steps=2)
    for step in range(1, 7):
        train(opt, model, 1, seed=90 + step)
        if step % 2 == 0:
            assert torch.equal(flat(model), hvd.broadcast(flat(model), 0)), step
    outer = opt.state_dict()["hvd_sgp"]["outer"]
    assert len(outer["momentum"]) == 1 and np.abs(outer["momentum"][0]).max() > 0
    diffs = {name: snapshot_resume(kwargs) for name, kwargs in (
        ("slowmo on sgp", dict(slowmo=0.6, local_steps=2)),
        ("slowmo on local sgd", dict(slowmo=0.6, local_steps=3, mode="allreduce")),
        ("topk:0.2", dict(compression=hvd.Compression.topk(0.2))),
        ("int8 no-ef", dict(compression=hvd.Compression.int8, error_feedback=False)))}
    # the random graph's weights move from its 7th phase on (3 and 4 nodes)
    diffs["randomk:0.3 random graph (run weights)"] = snapshot_resume(
        dict(compression=hvd.Compression.randomk(0.3), topology="random"), steps=12)
    assert max(diffs.values()) < 1e-6, diffs
    state = opt.state_dict()["hvd_sgp"]
    return (f"SlowMo: one model after each outer step, momentum checkpointed; resume is exact "
            f"for {', '.join(diffs)} ({max(diffs.values()):.1e}); keys {sorted(state)}")


@checks.when("check_keras" in sys.argv)  # a launch of its own: it imports TensorFlow
def check_keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import hvd_sgp.tensorflow.keras as hvdk
    from hvd_sgp.common.topology import exponential_offsets

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(me)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    expect_error(OptionError, lambda: hvdk.DistributedOptimizer(
        keras.optimizers.SGD(0.05), compression=hvdk.Compression.topk(2.0)), rank=me)
    results = {}
    for name, kwargs in (("topk:0.25", dict(compression=hvdk.Compression.topk(0.25))),
                         ("int8 local_steps=2", dict(compression=hvdk.Compression.int8,
                                                      local_steps=2))):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False)])
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05), **kwargs)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=4, verbose=0,
                  callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
        state = opt.sgp_state()
        results[name] = (float(model.evaluate(x, y, verbose=0)), opt.metrics()["bytes_sent"],
                         state["iteration"], len(state["compressed"]))
    # 64 steps; one push per exchange to one peer; each of the graph's edges opens with the
    # exact message (24-byte header + 4 float32), then 24 + 8 bytes: 1 top-k entry, or 4 int8
    # values and a scale
    edges = len(exponential_offsets(n))
    for name, pushes in (("topk:0.25", 64), ("int8 local_steps=2", 32)):
        loss, sent, steps, buffers = results[name]
        assert loss < 0.05 and steps == 64 and buffers == 1, results
        assert sent == edges * 40 + (pushes - edges) * 32 if n > 1 else sent == 0, results
    return ("Keras fit trains with top-k and with int8 + local_steps=2, pushing the bytes the "
            f"codecs say: {results}")


checks.run()
