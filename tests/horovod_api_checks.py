"""Checks of the Horovod-API collectives (hvd_sgp.common.horovod_api through hvd_sgp.torch) on
real MPI processes; run by test_horovod_api.py on n ranks, several checks per launch.

Arguments select checks by name (default: the main set). ``check_timeouts`` expects a small
HVD_SGP_TIMEOUT and HOROVOD_STALL_CHECK_TIME_SECONDS in the environment and ends with every
collective failing, so it runs alone. Each check prints "ok <name>" on rank 0; a failure
raises and ends the job non-zero.
"""
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common.errors import CollectiveTimeoutError, HorovodInternalError
from hvd_sgp.common.horovod_api.join import (register_join_participant,
                                             unregister_join_participant)
from hvd_sgp.common.mpi import MPI

hvd.init()
torch.set_num_threads(1)
n, me = hvd.size(), hvd.rank()
only = set(sys.argv[1:])


def ok(name):
    hvd.barrier()
    if me == 0:
        print(f"ok {name}", flush=True)


def info(line):
    if me == 0:
        print(f"info {line}", flush=True)


def failure(kind, action):
    """The exception ``action()`` raises, which must be a ``kind``."""
    try:
        action()
    except kind as e:
        return e
    raise AssertionError(f"no {kind.__name__} raised")


def same_everywhere(error):
    """The error's message, checked to be the same on every rank (beyond the rank prefix)."""
    body = str(error).split(": ", 1)[1]
    everyone = hvd.allgather_object(body)
    assert len(set(everyone)) == 1, everyone
    return body


def check_mismatches_raise_on_every_rank():
    if n == 1:
        return
    cases = [
        ("shape", lambda: hvd.allreduce(torch.ones(3 + me)), ["shape", "(3,)", "(4,)"]),
        ("dtype", lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if me else torch.int32)),
         ["dtype", "torch.int32", "torch.float32"]),
        ("ndim", lambda: hvd.allgather(torch.ones(6) if me else torch.ones(2, 3)),
         ["number of dimensions"]),
        ("trailing shape", lambda: hvd.allgather(torch.ones(2, 3 + me)), ["beyond the first"]),
        ("root", lambda: hvd.broadcast(torch.ones(2), root_rank=me), ["root rank"]),
        ("op", lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if me else hvd.Max),
         ["reduction op", "Max", "Sum"]),
        ("prescale", lambda: hvd.allreduce(torch.ones(2), prescale_factor=1.0 + me),
         ["prescale_factor"]),
        ("kind", lambda: (hvd.allreduce(torch.ones(2), name="same") if me else
                          hvd.allgather(torch.ones(2), name="same")),
         ["different collectives", "allreduce", "allgather"]),
        ("count", lambda: hvd.grouped_allreduce([torch.ones(1)] * (1 + me)),
         ["number of tensors"]),
    ]
    for label, action, fragments in cases:
        body = same_everywhere(failure(HorovodInternalError, action))
        assert all(f in body for f in fragments), (label, body)
        assert "rank 0" in body and ("rank 1" in body or "ranks 1" in body), (label, body)
    # a local argument error: ValueError where it is found, the same news everywhere else
    bad = me == n - 1
    splits = torch.tensor([5] + [0] * (n - 1)) if bad else torch.ones(n, dtype=torch.int32)
    error = failure(ValueError if bad else HorovodInternalError,
                    lambda: hvd.alltoall(torch.ones(n), splits))
    assert "splits" in str(error) and (bad or f"rank {n - 1}" in str(error)), error
    hvd.allreduce(torch.ones(1))  # the set is healthy afterwards
    ok("mismatched shape/dtype/ndim/root/op/scale/kind/count raise one error on every rank; "
       "a local argument error reaches every rank")


def check_duplicate_names():
    if n == 1:
        return
    t = torch.ones(2, 2)
    if me == 0:
        first = hvd.allgather_async(t, name="duplicate_name")
        failure(ValueError, lambda: hvd.allgather_async(t, name="duplicate_name"))
    hvd.barrier()  # a different name completes while 'duplicate_name' is pending
    if me != 0:
        first = hvd.allgather_async(t, name="duplicate_name")
    error = failure(HorovodInternalError, lambda: hvd.synchronize(first))
    assert "submitted again on rank 0" in same_everywhere(error), error
    ok("two concurrent ops named alike on rank 0: ValueError there, the op fails on every rank")


def check_process_sets():
    if n == 1:  # the only set of one rank is the global one
        failure(ValueError, lambda: hvd.add_process_set([0]))
        return
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    even = hvd.add_process_set(evens)
    odd = hvd.add_process_set(odds)
    mine, ranks = (even, evens) if me % 2 == 0 else (odd, odds)
    assert mine.included() and mine.size() == len(ranks) and mine.rank() == ranks.index(me)
    assert hvd.process_set_comm(mine).Get_size() == len(ranks)
    other = odd if mine is even else even
    assert other.included() is False and other.rank() is None
    assert hvd.process_set_comm(other) is None
    failure(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=other))
    total = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=mine)
    assert total.item() == sum(ranks)
    gathered = hvd.allgather(torch.tensor([me]), process_set=mine)
    assert gathered.tolist() == ranks
    root = ranks[-1]
    assert hvd.broadcast(torch.tensor([me]), root, process_set=mine).item() == root
    failure(ValueError, lambda: hvd.broadcast(torch.tensor([me]), n, process_set=mine))
    rows = hvd.reducescatter(torch.ones(2 * len(ranks), 1), op=hvd.Sum, process_set=mine)
    assert rows.shape == (2, 1) and rows.sum().item() == 2 * len(ranks)
    assert hvd.allgather_object(me, process_set=mine) == ranks
    assert hvd.broadcast_object(f"from {root}" if me == root else None, root,
                                process_set=mine) == f"from {root}"
    hvd.barrier(process_set=mine)
    failure(ValueError, lambda: hvd.add_process_set(evens))  # duplicate, on every rank
    failure(ValueError, lambda: hvd.ProcessSet([0, "a"]))
    failure(ValueError, lambda: hvd.add_process_set([n]))
    stray = hvd.ProcessSet([0])
    failure(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=stray))
    assert hvd.remove_process_set(even) and even.process_set_id is None
    assert hvd.remove_process_set(odd)
    assert not hvd.remove_process_set(hvd.global_process_set)
    assert not hvd.remove_process_set(even)
    failure(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=even))
    mismatch = failure(HorovodInternalError, lambda: hvd.add_process_set([0] if me == 0 else [1]))
    assert "different process sets" in same_everywhere(mismatch), mismatch
    # init(process_sets=...) with sets made from communicators: each rank passes its own
    parity = hvd.ProcessSet(MPI.COMM_WORLD.Split(me % 2, me))
    hvd.init(process_sets=[parity])
    still_registered.append(parity)
    assert parity.ranks == ranks and parity.size() == len(ranks)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=parity).item() == len(ranks)
    # each rank holds a different set: removing "its" set is a disagreement
    mismatch = failure(HorovodInternalError, lambda: hvd.remove_process_set(parity))
    assert "removed different process sets" in same_everywhere(mismatch), mismatch
    ok("process sets: own communicators, global root ranks, Horovod's errors, add/remove, "
       "init(process_sets=) from communicators")


def check_join():
    for first in range(n):
        steps = (me - first) % n  # `first` joins at once, (first - 1) % n last
        for s in range(steps):
            out = hvd.allreduce(torch.tensor([1.0, me]), op=hvd.Sum, name=f"step.{s}")
            active = [r for r in range(n) if (r - first) % n > s]
            assert out.tolist() == [len(active), sum(active)], (first, s, out)
            mean = hvd.allreduce(torch.tensor([2 * me + 1]), name=f"mean.{s}")  # Average, int
            assert mean.item() == int(sum(2 * r + 1 for r in active) / n), (mean, active)
            big = hvd.allreduce(torch.full((3000,), me + 1), op=hvd.Min, name=f"min.{s}")
            assert torch.all(big == min(active) + 1), (big[:3], active)
        if steps == n - 1 and n > 1:
            error = failure(HorovodInternalError, lambda: hvd.allgather(torch.ones(1)))
            assert "already called join()" in str(error), error
            hvd.barrier()  # joined ranks take part in barriers
        last = hvd.join()
        assert last == (first - 1) % n, (first, last)
        assert hvd.allgather_object(last) == [last] * n
    ok("join: joined ranks add the identity (Average still divides by n), allgather "
       "involving them fails, barrier works, join() returns the last rank everywhere")


class Ring:
    """A stand-in for the optimizer as a join participant: iteration k sends k to the right
    neighbour and receives k from the left, non-blocking, on its own communicator."""

    def __init__(self):
        self.comm = MPI.COMM_WORLD.Dup()
        self.started = self.done = self.served = 0
        self.flight = None

    def _start(self):
        k = self.started
        self.started += 1
        out, got = np.array([k], np.int64), np.empty(1, np.int64)
        self.flight = (k, [self.comm.Isend(out, (me + 1) % n, k),
                           self.comm.Irecv(got, (me - 1) % n, k)], out, got)

    def _test(self):
        k, requests, _, got = self.flight
        if not MPI.Request.Testall(requests):
            return False
        assert got[0] == k, (got, k)
        self.done += 1
        self.flight = None
        return True

    def step(self):
        """What a training step's gossip does (blocking)."""
        self._start()
        while not self._test():
            time.sleep(1e-4)

    def serve(self, poll):
        self.served += 1
        if self.flight is None:
            self._start()
            return True
        return self._test()

    def started_iteration(self):
        return self.started

    def finish(self, last, poll):
        while self.done < last:
            if self.flight is None:
                self._start()
            while not self._test():
                poll()
                time.sleep(1e-4)


def check_join_participants():
    for first in range(n):
        ring = Ring()
        register_join_participant(ring)
        steps = 2 * ((me - first) % n)
        for s in range(steps):
            ring.step()
            hvd.allreduce(torch.ones(1), name=f"p.{s}")
        hvd.join()
        unregister_join_participant(ring)
        counts = hvd.allgather_object((ring.started, ring.done, ring.served))
        assert len({(a, b) for a, b, _ in counts}) == 1 and counts[0][0] == counts[0][1], counts
        assert counts[0][0] >= 2 * (n - 1), counts
        assert n == 1 or counts[first][2] > 0, counts  # the first to join served the ring
        hvd.barrier()
        assert not ring.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # no message left over
        ring.comm.Free()
    ok("join participants: served while joined, then all finish the same last iteration")


def check_values_and_scaling():
    a = torch.arange(2 * n * 3, dtype=torch.float64).reshape(2 * n, 3) + me
    rs = hvd.reducescatter(a, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    want = (torch.arange(2 * n * 3, dtype=torch.float64).reshape(2 * n, 3) * n
            + sum(range(n))) * 1.5
    assert torch.allclose(rs, want[2 * me:2 * me + 2]), (rs, want)
    uneven = hvd.reducescatter(torch.ones(n + 1, 2), op=hvd.Average)
    assert uneven.shape == ((2 if me == 0 else 1), 2) and torch.all(uneven == 1)
    ints = hvd.reducescatter(torch.full((n, 1), 7, dtype=torch.int32), op=hvd.Average,
                             postscale_factor=0.5)
    assert ints.dtype == torch.int32 and ints.item() == 3  # 7 * 0.5 truncated, as Horovod
    pre = hvd.allreduce(torch.tensor([3], dtype=torch.int64), op=hvd.Sum, prescale_factor=0.5)
    assert pre.item() == n * 1  # int(3 * 0.5) = 1 per rank
    half = hvd.allreduce(torch.tensor([1.5], dtype=torch.float16), op=hvd.Sum,
                         postscale_factor=0.25)
    assert half.dtype == torch.float16 and half.item() == 1.5 * n * 0.25
    bf = hvd.allreduce(torch.tensor([1.5], dtype=torch.bfloat16), op=hvd.Max)
    assert bf.dtype == torch.bfloat16 and bf.item() == 1.5
    assert hvd.broadcast(torch.tensor([me], dtype=torch.bfloat16), 0).item() == 0
    mins = hvd.grouped_allreduce([torch.tensor([me]), torch.tensor([float(me)])], op=hvd.Min)
    assert [m.item() for m in mins] == [0, 0.0] and mins[0].dtype == torch.int64
    handle = hvd.grouped_allreduce_async_([torch.ones(2), torch.ones(3, dtype=torch.int32)],
                                          op=hvd.Sum)
    while not hvd.poll(handle):
        time.sleep(1e-4)
    assert all(torch.all(t == n) for t in hvd.synchronize(handle))
    sparse = torch.sparse_coo_tensor([[me % 3]], [1.0], (3,))
    dense = hvd.sparse_allreduce_async(sparse, "sparse", hvd.Sum)().to_dense()
    assert dense.sum().item() == n and dense[me % 3].item() >= 1
    ok("reducescatter pre/postscale and uneven rows, integer and 16-bit scaling, grouped, "
       "async in place, sparse")


def check_gradients():
    x = torch.ones(me + 1, 2, dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(x)
    gathered.backward(torch.arange(gathered.shape[0], dtype=torch.float64)[:, None].expand(-1, 2))
    first = sum(range(1, me + 1))
    assert torch.equal(x.grad[:, 0], torch.arange(first, first + me + 1, dtype=torch.float64))
    y = torch.ones(2 * n, 2, requires_grad=True)
    hvd.reducescatter(y, op=hvd.Sum, prescale_factor=2.0).sum().backward()
    assert torch.all(y.grad == 2 * n), y.grad
    z = torch.ones(3, requires_grad=True)
    hvd.broadcast(z, root_rank=n - 1).sum().backward()
    assert torch.all(z.grad == (1.0 if me == n - 1 else 0.0))
    w = torch.arange(n, dtype=torch.float32, requires_grad=True)
    out, _ = hvd.alltoall(w * (me + 1), torch.ones(n, dtype=torch.int32))
    (out * torch.arange(n)).sum().backward()
    assert torch.equal(w.grad, torch.full((n,), float(me)) * (me + 1)), w.grad
    v = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
    sum(t.sum() for t in hvd.grouped_allreduce(v, op=hvd.Sum)).backward()
    assert all(torch.all(t.grad == n) for t in v)
    ok("gradients of allgather (own rows of the average), reducescatter (scaled allgather), "
       "broadcast (root only), alltoall (routed back), grouped allreduce")


class Doubling(hvd.Compression.none):
    """A user's compressor in Horovod's interface: float64 on the wire, values doubled."""

    @staticmethod
    def compress(tensor):
        return tensor.double() * 2, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return (tensor / 2).to(ctx)


def check_custom_compressor():
    out = hvd.allreduce(torch.full((2,), float(me), dtype=torch.float32), compression=Doubling,
                        op=hvd.Sum)
    assert out.dtype == torch.float32 and torch.all(out == sum(range(n)))
    rs = hvd.reducescatter(torch.ones(n, 1), compression=Doubling, op=hvd.Sum)
    assert rs.dtype == torch.float32 and rs.item() == n
    ok("a user's Compressor subclass is applied around allreduce and reducescatter")


def check_sync_batch_norm():
    torch.manual_seed(0)
    sizes = [2 + r for r in range(n)]  # different batch sizes per rank
    full = torch.randn(sum(sizes), 3, 5, dtype=torch.float64)
    weights = torch.randn_like(full)
    lo = sum(sizes[:me])
    mine = full[lo:lo + sizes[me]].clone().requires_grad_()
    reference = torch.nn.BatchNorm1d(3).double()
    synced = hvd.SyncBatchNorm(3).double()
    with torch.no_grad():
        for bn in (reference, synced):
            bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    whole = full.clone().requires_grad_()
    ref_out = reference(whole)
    (ref_out * weights).sum().backward()
    out = synced(mine)
    (out * weights[lo:lo + sizes[me]]).sum().backward()
    assert torch.allclose(out, ref_out[lo:lo + sizes[me]], atol=1e-10)
    assert torch.allclose(mine.grad, whole.grad[lo:lo + sizes[me]], atol=1e-10)
    for mine_p, ref_p in ((synced.weight, reference.weight), (synced.bias, reference.bias)):
        assert torch.allclose(hvd.allreduce(mine_p.grad, op=hvd.Sum), ref_p.grad, atol=1e-10)
    assert torch.allclose(synced.running_mean, reference.running_mean, atol=1e-12)
    assert torch.allclose(synced.running_var, reference.running_var, atol=1e-12)
    synced.eval()
    reference.eval()
    assert torch.allclose(synced(mine.detach()), reference(mine.detach()))
    ok("SyncBatchNorm forward, backward and running stats equal BatchNorm over the whole batch")


def check_state_broadcasts():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    torch.manual_seed(me)
    for p in model.parameters():
        p.data.normal_()
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0), flat)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert opt.param_groups[0]["lr"] == 0.1 and len(opt.state_dict()["state"]) > 0
    assert all(p.grad is not None for p in model.parameters())  # Horovod leaves zeros
    ok("broadcast_parameters of tensors and (name, tensor) pairs; broadcast_optimizer_state "
       "initializes a fresh optimizer's state, model= accepted")


def check_large_broadcasts():
    """From CHAIN_MIN_BYTES on 3 ranks or more a broadcast goes down a chain of segments
    (collectives._chain): from every root, mixed dtypes fused into several buffers whose sizes
    are not multiples of a segment, just under and at the threshold, and a large object, every
    rank gets root's bytes exactly; so does Adam's state in broadcast_optimizer_state."""
    from hvd_sgp.common.horovod_api import collectives
    floats = collectives.CHAIN_MIN_BYTES // 4
    for root in range(n):
        g = torch.Generator().manual_seed(100 * me + root)
        mine = {"a": torch.randn(floats + 12345, generator=g),
                "b": torch.randn(700_001, generator=g).half(),
                "c": torch.randint(0, 2**40, (3,), generator=g),
                "d": torch.rand(1001, generator=g) > 0.5,
                "under": torch.randn(floats - 1, generator=g),
                "at": torch.randn(floats, generator=g)}
        expected = hvd.allgather_object({k: v.clone() for k, v in mine.items()})[root]
        hvd.broadcast_parameters({k: mine[k] for k in "abcd"}, root_rank=root)
        for k in ("under", "at"):
            mine[k] = hvd.broadcast(mine[k], root_rank=root)
        for k, v in mine.items():
            assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), (root, k)
        big = hvd.broadcast_object(bytes(range(256)) * 40_000 if me == root else None, root)
        assert big == bytes(range(256)) * 40_000
    # In place, large arrays receive root's bytes themselves (no copy): a tensor named twice
    # (tied weights), a non-contiguous one; a broadcast that is not in place leaves its input.
    g = torch.Generator().manual_seed(7 + me)
    tied, wide = torch.randn(600_000, generator=g), torch.randn(1000, 800, generator=g)
    kept = torch.randn(floats, generator=g)
    expected = hvd.allgather_object((tied.clone(), wide.clone(), kept.clone()))[n - 1]
    before = kept.clone()
    hvd.broadcast_parameters({"tied": tied, "also": tied, "wide": wide.t()}, root_rank=n - 1)
    got = hvd.broadcast(kept, root_rank=n - 1)
    assert torch.equal(tied, expected[0]) and torch.equal(wide, expected[1])
    assert torch.equal(got, expected[2]) and torch.equal(kept, before)
    layer = torch.nn.Linear(1100, 1000)  # Adam's two moments of 4.4 MB each, and its steps
    adam = torch.optim.Adam(layer.parameters(), lr=0.01)
    for _ in range(me + 1):  # a different state on every rank
        adam.zero_grad()
        layer(torch.randn(4, 1100)).pow(2).sum().backward()
        adam.step()
    adam.state[layer.bias]["wide"] = torch.randn(50, 40, generator=g).t()  # not contiguous
    expected = hvd.allgather_object(adam.state_dict())[n - 1]
    moments = [adam.state[layer.weight][k].data_ptr() for k in ("exp_avg", "exp_avg_sq")]
    hvd.broadcast_optimizer_state(adam, root_rank=n - 1)
    got = adam.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert moments == [adam.state[layer.weight][k].data_ptr()  # received into, not copied
                       for k in ("exp_avg", "exp_avg_sq")]
    for i, slots in expected["state"].items():
        for k, v in slots.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    ok(f"broadcasts of {collectives.CHAIN_MIN_BYTES >> 20} MiB and more from every root "
       f"({'a chain of segments' if n >= 3 else 'Ibcast'}) equal root's bytes, in place and "
       "not")


def check_timeline():
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "timeline.json"), 0)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.stop_timeline()
    if me == 0:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        names = {e["name"] for e in events}
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= names, names
        assert any(e.get("args", {}).get("tensor") == "test_allreduce" for e in events)
        assert {e["pid"] for e in events} == set(range(n))
    ok("start_timeline/stop_timeline record negotiations, data phases and cycles")


def check_api_names():
    for name in ("HorovodInternalError", "HostsUpdatedInterrupt", "ProcessSet",
                 "add_process_set", "remove_process_set", "global_process_set", "ccl_built",
                 "ddl_built", "mpi_enabled", "start_timeline", "stop_timeline", "SyncBatchNorm",
                 "grouped_allgather", "grouped_reducescatter", "grouped_allreduce_",
                 "reducescatter_async", "alltoall_async", "sparse_allreduce_async", "join"):
        assert hasattr(hvd, name), name
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert not hvd.ccl_built() and not hvd.ddl_built() and hvd.mpi_enabled()
    assert hvd.HostsUpdatedInterrupt(True).skip_sync
    ok("Horovod's names: errors, build flags, process sets, timeline, SyncBatchNorm")


still_registered = []  # process sets that check_process_sets leaves registered


def check_shutdown_and_init_again():
    assert all(ps.process_set_id is not None for ps in still_registered)
    hvd.shutdown()
    assert not hvd.is_initialized()
    assert all(ps.process_set_id is None for ps in still_registered)
    hvd.init()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n
    ok("shutdown then init starts the collective layer afresh (old sets are invalidated)")


def check_blocked_rank_cpu():
    """A rank blocked 5 s in allgather (its peer is late) must leave the core to others."""
    if n == 1:
        return
    if me == 1:
        time.sleep(5)
    began, usage = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    hvd.allgather(torch.ones(2))
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    if me != 1:
        assert wall > 4 and cpu / wall < 0.10, (wall, cpu)
    figures = hvd.allgather_object((round(wall, 2), round(cpu, 3)))
    info(f"blocked-rank cpu (wall s, cpu s) per rank: {figures}")
    ok("a rank blocked 5 s in allgather uses < 10% of a core")


def check_negotiation_cost():
    x = torch.ones(4)
    comm, raw = MPI.COMM_WORLD.Dup(), np.ones(4, np.float32)
    for _ in range(50):
        hvd.allreduce(x)
    figures = {}
    for label, call in (("hvd.allreduce", lambda: hvd.allreduce(x)),
                        ("raw MPI_Allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, raw))):
        hvd.barrier()
        began = time.perf_counter()
        for _ in range(300):
            call()
        figures[label] = (time.perf_counter() - began) / 300 * 1e6
    comm.Free()
    info(f"microseconds per small allreduce on {n} ranks: " +
         ", ".join(f"{k} {v:.0f}" for k, v in figures.items()))
    ok("negotiation cost measured")


def check_timeouts():
    """Needs HVD_SGP_TIMEOUT ~2 s and a stall warning at ~1 s; ends with the global set broken."""
    timeout = float(os.environ["HVD_SGP_TIMEOUT"])
    pair = hvd.add_process_set([0, 1])
    late = n - 1
    if me == late:
        time.sleep(timeout + 2)
    error = failure(CollectiveTimeoutError, lambda: hvd.allreduce(torch.ones(1), name="t"))
    assert f"waiting for rank {late}" in str(error), error
    failure(CollectiveTimeoutError, lambda: hvd.allreduce(torch.ones(1)))  # broken: at once
    if me in (0, 1):  # the coordinator itself stays silent past the deadline
        if me == 0:
            time.sleep(timeout * 1.1 + 2)
        error = failure(CollectiveTimeoutError, lambda: hvd.allreduce(torch.ones(1),
                                                                      process_set=pair))
        assert me == 0 or "no answer from the coordinator (rank 0)" in str(error), error
    print(f"timeouts ok on rank {me}", flush=True)


main = [check_api_names, check_mismatches_raise_on_every_rank, check_duplicate_names,
        check_process_sets, check_join, check_join_participants, check_values_and_scaling,
        check_gradients, check_custom_compressor, check_sync_batch_norm, check_state_broadcasts,
        check_large_broadcasts, check_timeline, check_negotiation_cost,
        check_shutdown_and_init_again]
extra = [check_blocked_rank_cpu, check_timeouts]
for check in main + extra:
    if (not only and check in main) or check.__name__ in only:
        check()
if me == 0 and not only & {"check_timeouts"}:
    print(f"all horovod api checks passed on {n} ranks", flush=True)
