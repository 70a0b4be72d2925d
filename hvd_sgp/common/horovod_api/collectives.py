"""Horovod's collectives on numpy arrays, negotiated first (negotiation.py) and run on the
process set's private communicator. Framework adapters turn tensors into arrays and back;
every MPI call of these collectives happens here.

Data phases (non-blocking, one step unless noted):
  allreduce      arrays fused per dtype, one Iallreduce per dtype
  allgather      one Iallgatherv per array, every rank's first dimension from the negotiation
  broadcast      fused per dtype, one Ibcast per dtype; from CHAIN_MIN_BYTES on 3 ranks or
                 more, a pipelined chain of point-to-point segments (many steps)
  alltoall       Ialltoall of the split counts, then one Ialltoallv (two steps)
  reducescatter  one Ireduce_scatter per array; earlier ranks take the remainder rows
  barrier        Ibarrier
Data moves in an MPI collective (a large broadcast in a chain of sends), so the ranks leave
a collective about together (scripts line ranks up with a small allreduce, as with Horovod;
a result computed by the coordinator and sent back would release it a message earlier than
the others).
Scaling follows Horovod: integers are scaled in float64 and truncated, 16-bit floats in
float32 (and reduced in float32: MPI has no half type); Average divides by the set size. A
joined rank takes part in allreduce, reducescatter and barrier with the reduction's identity
(zeros for Sum and Average, whose divisor stays the whole set's size, as Horovod's).
"""
from __future__ import annotations

import enum
import pickle
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from hvd_sgp.common import place
from hvd_sgp.common.errors import HorovodInternalError, SgpValueError
from hvd_sgp.common.horovod_api import negotiation, process_sets
from hvd_sgp.common.horovod_api.negotiation import (TAG_CHAIN, Controller, Handle, Kind,
                                                    Operation, Request, TensorSpec)
from hvd_sgp.common.horovod_api.process_sets import ProcessSet, global_process_set
from hvd_sgp.common.mpi import MPI


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (same integer values as horovod.common.basics)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


_MPI_OPS = {ReduceOp.Average: MPI.SUM, ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN,
            ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}


def check_op(op: Any) -> ReduceOp:
    """``op`` as a ReduceOp, or the clear error (Adasum is not offered: SGP replaces the
    gradient allreduce it serves)."""
    try:
        op = ReduceOp(op)
    except (TypeError, ValueError):
        raise SgpValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max or "
                            "Product") from None
    if op == ReduceOp.Adasum:
        raise SgpValueError("op=Adasum is not offered by hvd_sgp: SGP already replaces the "
                            "gradient allreduce; use op=Average (the default)")
    return op


# --- dtypes and scaling --------------------------------------------------------------------
def _work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype MPI reduces in: 16-bit floats widen to float32."""
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _raw(array: np.ndarray) -> np.ndarray:
    """The same bytes in a type MPI moves (no half or bool types in MPI's C bindings)."""
    if array.dtype == np.float16:
        return array.view(np.uint16)
    if array.dtype == np.bool_:
        return array.view(np.uint8)
    return array


def _prescaled(array: np.ndarray, factor: float) -> np.ndarray:
    """A fresh copy in the work dtype, scaled as Horovod's: integers in float64 (truncated
    back), 16-bit floats in float32 (rounded back to 16 bits), other floats in their dtype."""
    if factor == 1.0:
        return np.array(array, dtype=_work_dtype(array.dtype))
    if array.dtype.kind in "iu":
        return (array * np.float64(factor)).astype(array.dtype)
    if array.dtype == np.float16:
        scaled = (array.astype(np.float32) * np.float32(factor)).astype(np.float16)
        return scaled.astype(np.float32)
    return array * array.dtype.type(factor)


def _postscaled(total: np.ndarray, dtype: np.dtype, divisor: int, factor: float) -> np.ndarray:
    """Average's division and the postscale factor, in float64 for integers (truncated, as
    Horovod's) and in the work dtype for floats; the result in ``dtype``."""
    if divisor == 1 and factor == 1.0:
        return total.astype(dtype, copy=False)
    if dtype.kind in "iu":
        value = total.astype(np.float64)
        value /= divisor
        value *= factor
        return value.astype(dtype)
    if divisor != 1:
        total /= total.dtype.type(divisor)
    if factor != 1.0:
        total *= total.dtype.type(factor)
    return total.astype(dtype, copy=False)


def _identity(op: ReduceOp, spec: TensorSpec) -> np.ndarray:
    """What a joined rank contributes: the identity of the reduction."""
    dtype = np.dtype(spec.wire)
    if op in (ReduceOp.Sum, ReduceOp.Average):
        return np.zeros(spec.shape, dtype)
    if op == ReduceOp.Product:
        return np.ones(spec.shape, dtype)
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    high = info.max if info else np.inf
    low = info.min if info else -np.inf
    return np.full(spec.shape, high if op == ReduceOp.Min else low, dtype)


class _Fused:
    """Arrays packed into one flat buffer per dtype (one MPI call per dtype). ``fill``: with
    the arrays' values (else empty, to receive); ``own``: the arrays are fresh copies, so a
    lone array can be its own buffer. A broadcast gives each array of DIRECT_MIN_BYTES or
    more a buffer of its own (``separate``: a layout every rank derives alike from the
    negotiated shapes), and with ``into`` (in place) that buffer is the array itself where it
    can be: sent from and received into without a copy (at 100 MB the copies in and out
    cost more than the transfer on one host)."""

    def __init__(self, arrays: Sequence[np.ndarray], fill: bool = True, own: bool = False,
                 separate: bool = False, into: bool = False):
        self.shapes = [a.shape for a in arrays]
        self.groups: list[list[int]] = []  # the arrays' indices in each buffer
        self.buffers: list[np.ndarray] = []
        packed: dict[np.dtype, list[int]] = {}
        taken: set[int] = set()  # (a tensor named twice, as tied weights are, is copied)
        for i, a in enumerate(arrays):
            if not (own and len(arrays) == 1 or separate and a.nbytes >= DIRECT_MIN_BYTES):
                packed.setdefault(a.dtype, []).append(i)
                continue
            self.groups.append([i])  # a buffer of its own: the array itself where it can be
            if own or into and a.flags.c_contiguous and a.flags.writeable and (
                    a.ctypes.data not in taken):
                taken.add(a.ctypes.data)
                self.buffers.append(a.reshape(-1))
            else:
                self.buffers.append(a.flatten() if fill else np.empty(a.size, a.dtype))
        for dtype, members in packed.items():
            self.groups.append(members)
            if fill:
                parts = [np.ravel(arrays[i]) for i in members]
                self.buffers.append(parts[0].copy() if len(parts) == 1 else np.concatenate(parts))
            else:
                self.buffers.append(np.empty(sum(arrays[i].size for i in members), dtype))

    def parts(self) -> list[np.ndarray]:
        out: list[Optional[np.ndarray]] = [None] * len(self.shapes)
        for buffer, members in zip(self.buffers, self.groups):
            offset = 0
            for i in members:
                size = int(np.prod(self.shapes[i], dtype=np.int64))
                out[i] = buffer[offset:offset + size].reshape(self.shapes[i])
                offset += size
        return out


DIRECT_MIN_BYTES = 1 << 20  # a broadcast's array this large has a buffer of its own


def _displacements(counts: Sequence[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()


def _rows(total: int, n: int, r: int) -> int:
    """Rows of ``total`` that rank r keeps in a reducescatter (earlier ranks take the rest)."""
    base, extra = divmod(total, n)
    return base + (1 if r < extra else 0)


# --- the kinds ----------------------------------------------------------------------------
def _agree(ctl: Controller, requests: dict[int, Request], what: str,
           value: Callable[[Request], Any]) -> str:
    values = {r: value(q) for r, q in requests.items()}
    if len(set(values.values())) <= 1:
        return ""
    return f"ranks disagree on {what}: {ctl.disagreement(values)}"


def _agree_on_tensors(ctl: Controller, requests: dict[int, Request], whole_shape: bool) -> str:
    """Same number of tensors, and per tensor the same dtype, number of dimensions, device and
    shape (all of it, or all but the first dimension)."""
    problem = _agree(ctl, requests, "the number of tensors", lambda q: len(q.specs))
    count = len(next(iter(requests.values())).specs)
    for i in range(count if not problem else 0):
        of = "" if count == 1 else f" of tensor {i}"
        checks = [("the dtype", lambda q: q.specs[i].dtype),
                  ("the number of dimensions", lambda q: len(q.specs[i].shape)),
                  ("the device", lambda q: q.specs[i].device),
                  ("the shape" if whole_shape else "the shape beyond the first dimension",
                   lambda q: q.specs[i].shape if whole_shape else q.specs[i].shape[1:])]
        for what, value in checks:
            problem = _agree(ctl, requests, what + of, value)
            if problem:
                return problem
    return problem


class _Allreduce(Kind):
    name = "allreduce"
    joinable = True

    def check(self, requests, ctl):
        return (_agree_on_tensors(ctl, requests, True)
                or _agree(ctl, requests, "the reduction op", lambda q: ReduceOp(q.op).name)
                or _agree(ctl, requests, "prescale_factor", lambda q: q.prescale)
                or _agree(ctl, requests, "postscale_factor", lambda q: q.postscale))

    def phase(self, op, ctl):
        request = op.request
        reduction = ReduceOp(request.op)
        inputs = op.arrays if op.arrays is not None else [
            _identity(reduction, s) for s in request.specs]
        fused = _Fused([_prescaled(a, request.prescale) for a in inputs], own=True)
        yield [ctl.comm.Iallreduce(MPI.IN_PLACE, b, op=_MPI_OPS[reduction])
               for b in fused.buffers], False
        divisor = ctl.size if reduction == ReduceOp.Average else 1
        return [_postscaled(part, a.dtype, divisor, request.postscale)
                for part, a in zip(fused.parts(), inputs)]


class _Reducescatter(_Allreduce):
    name = "reducescatter"

    def phase(self, op, ctl):
        request = op.request
        reduction = ReduceOp(request.op)
        inputs = op.arrays if op.arrays is not None else [
            _identity(reduction, s) for s in request.specs]
        sends, receives, requests = [], [], []
        for a in inputs:
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            send = _prescaled(a, request.prescale)
            receive = np.empty((_rows(a.shape[0], ctl.size, ctl.rank), *a.shape[1:]), send.dtype)
            counts = [_rows(a.shape[0], ctl.size, r) * row for r in range(ctl.size)]
            requests.append(ctl.comm.Ireduce_scatter(send, receive, counts, _MPI_OPS[reduction]))
            sends.append(send)
            receives.append(receive)
        yield requests, False
        divisor = ctl.size if reduction == ReduceOp.Average else 1
        return [_postscaled(r, a.dtype, divisor, request.postscale)
                for r, a in zip(receives, inputs)]


class _Allgather(Kind):
    name = "allgather"

    def check(self, requests, ctl):
        return _agree_on_tensors(ctl, requests, False)

    def first_dims(self, requests):
        count = len(requests[0].specs)
        return tuple(tuple(requests[r].specs[i].shape[0] for r in sorted(requests))
                     for i in range(count))

    def phase(self, op, ctl):
        outputs, requests = [], []
        for a, dims in zip(op.arrays, op.response.first_dims):
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            out = np.empty((sum(dims), *a.shape[1:]), a.dtype)
            counts = [d * row for d in dims]
            requests.append(ctl.comm.Iallgatherv(
                _raw(np.ascontiguousarray(a)), [_raw(out), (counts, _displacements(counts))]))
            outputs.append(out)
        yield requests, False
        return outputs


class _Broadcast(Kind):
    name = "broadcast"

    def check(self, requests, ctl):
        return (_agree(ctl, requests, "the root rank", lambda q: q.root)
                or _agree_on_tensors(ctl, requests, True))

    def phase(self, op, ctl):
        root = ctl.ranks.index(op.request.root)
        fused = _Fused(op.arrays, fill=ctl.rank == root, separate=True, into=op.into)
        if ctl.size >= 3 and sum(b.nbytes for b in fused.buffers) >= CHAIN_MIN_BYTES:
            yield from _chain(fused.buffers, root, ctl)
        else:
            yield [ctl.comm.Ibcast(_raw(b), root=root) for b in fused.buffers], False
        return fused.parts()


CHAIN_MIN_BYTES = 4 << 20  # a broadcast this large, on 3 ranks or more, goes down a chain
CHAIN_SEGMENT_BYTES = 1 << 20


def _chain(buffers: list[np.ndarray], root: int, ctl: Controller) -> Iterator[tuple[list, bool]]:
    """Root's bytes down the ranks in order from root, in segments: in round t the rank at
    position p (> 0) receives segment t - p + 1 from its predecessor while it passes segment
    t - p, got in the round before, to its successor. Every link carries the payload once and
    all links move at once, so it arrives at about the link's rate whatever the set's size, in
    (segments + n - 2) rounds. Why not Ibcast: on 8 hosts with 1 Gbit/s links Open MPI 5's
    broadcast of 200 MB (a replacement's model and momentum in hvd.elastic's sync) took 12 s,
    7 times one link's 1.7 s (docs/faults.md)."""
    n, rank = ctl.size, ctl.rank
    position = (rank - root) % n
    segments = [view[start:start + CHAIN_SEGMENT_BYTES]
                for view in (_raw(b).reshape(-1).view(np.uint8) for b in buffers)
                for start in range(0, view.size, CHAIN_SEGMENT_BYTES)]
    first = max(position - 1, 0)
    last = len(segments) - 1 + position - (position == n - 1)
    for t in range(first, last + 1):
        requests = []
        if position > 0 and 0 <= t - position + 1 < len(segments):
            requests.append(ctl.comm.Irecv([segments[t - position + 1], MPI.BYTE],
                                           (rank - 1) % n, TAG_CHAIN))
        if position < n - 1 and 0 <= t - position < len(segments):
            requests.append(ctl.comm.Isend([segments[t - position], MPI.BYTE], (rank + 1) % n,
                                           TAG_CHAIN))
        yield requests, t < last


class _Alltoall(Kind):
    name = "alltoall"

    def check(self, requests, ctl):
        return _agree_on_tensors(ctl, requests, False)

    def phase(self, op, ctl):
        array, splits = op.arrays
        received = np.empty(ctl.size, np.int64)
        yield [ctl.comm.Ialltoall(splits, received)], True
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        out = np.empty((int(received.sum()), *array.shape[1:]), array.dtype)
        sent, got = (splits * row).tolist(), (received * row).tolist()
        yield [ctl.comm.Ialltoallv([_raw(array), (sent, _displacements(sent))],
                                   [_raw(out), (got, _displacements(got))])], False
        return out, received


class _Barrier(Kind):
    name = "barrier"
    joinable = True

    def phase(self, op, ctl):
        yield [ctl.comm.Ibarrier()], False


for _kind in (_Allreduce(), _Reducescatter(), _Allgather(), _Broadcast(), _Alltoall(),
              _Barrier()):
    negotiation.register(_kind)


# --- submitting ---------------------------------------------------------------------------
def submit(kind: str, arrays: Optional[list], process_set: ProcessSet, name: Optional[str],
           dtypes: Optional[Sequence[str]] = None, devices: Optional[Sequence[str]] = None,
           problem: str = "", error: type = SgpValueError, side: Sequence[np.ndarray] = (),
           into: bool = False, **fields: Any) -> Operation:
    """Negotiate one collective of ``kind`` on ``arrays`` (``side`` arrays ride along
    undescribed; ``into``: see Operation). ``problem`` (an argument error the caller found)
    travels with the request so every rank fails; here it is raised as ``error``. ``fields``:
    op, root, prescale, postscale, extra of the Request."""
    ctl = process_sets.controller(process_set)
    arrays = [np.asarray(a) if isinstance(a, np.generic) else a for a in arrays or ()]
    problem = problem or next((p for p in map(_movable, arrays) if p), "")
    specs = () if problem else tuple(
        TensorSpec(a.shape, dtypes[i] if dtypes else str(a.dtype), a.dtype.str,
                   devices[i] if devices else "cpu") for i, a in enumerate(arrays))
    with negotiation.lock():
        request = Request(kind, name or ctl.next_name(), specs, error=problem, **fields)
        op = ctl.submit(request, arrays + list(side), into)
    if problem:
        raise error(f"{kind} {request.name!r}: {problem}")
    return op


def _movable(array: Any) -> str:
    if not isinstance(array, np.ndarray):
        return f"expected a numpy array, got {type(array).__name__}"
    if array.dtype.kind not in "biufc":
        return f"dtype {array.dtype} cannot travel through MPI"
    return ""


def _reduction_problem(arrays: Sequence[np.ndarray], op: ReduceOp) -> str:
    if op == ReduceOp.Adasum:
        return ("op=Adasum is not offered by hvd_sgp: SGP already replaces the gradient "
                "allreduce; use op=Average (the default)")
    bad = any(isinstance(a, np.ndarray) and a.dtype.kind == "b" for a in arrays)
    return "cannot reduce booleans" if bad else ""


def grouped_allreduce_async(arrays: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set,
                            dtypes: Optional[Sequence[str]] = None,
                            devices: Optional[Sequence[str]] = None) -> Handle:
    """Reduce every array across the set (one negotiation, one MPI call per dtype); the
    handle's result is the list of reduced arrays (new arrays, in the inputs' dtypes)."""
    op = ReduceOp(op)
    problem = _reduction_problem(arrays, op)
    return Handle(submit("allreduce", list(arrays), process_set, name, dtypes, devices,
                         problem, op=int(op), prescale=float(prescale_factor),
                         postscale=float(postscale_factor)))


def allreduce(array: np.ndarray, op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """One array reduced across the set (for metrics and state in the core's users)."""
    return grouped_allreduce_async([np.asarray(array)], op, prescale_factor, postscale_factor,
                                   name, process_set).wait()[0]


def grouped_allgather_async(arrays: Sequence[np.ndarray], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set,
                            dtypes: Optional[Sequence[str]] = None,
                            devices: Optional[Sequence[str]] = None) -> Handle:
    """Concatenate every rank's arrays along the first dimension (it may differ by rank; a
    0-d array counts as one row)."""
    arrays = [a.reshape(1) if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in arrays]
    return Handle(submit("allgather", arrays, process_set, name, dtypes, devices))


def grouped_broadcast_async(arrays: Sequence[np.ndarray], root_rank: int,
                            name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set,
                            dtypes: Optional[Sequence[str]] = None,
                            devices: Optional[Sequence[str]] = None,
                            into: bool = False) -> Handle:
    """Root's arrays on every rank of the set (``root_rank`` is a global rank, as Horovod's).
    ``into``: the arrays may be overwritten (an in-place broadcast); the large ones then
    receive root's values themselves, and are the result."""
    ranks = process_sets.ranks_of(process_set)
    problem = "" if root_rank in ranks else (
        f"root_rank {root_rank} is not a rank of the process set (ranks {list(ranks)})")
    return Handle(submit("broadcast", list(arrays), process_set, name, dtypes, devices, problem,
                         into=into, root=int(root_rank)))


def alltoall_async(array: np.ndarray, splits: Optional[Sequence[int]] = None,
                   name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                   dtype: Optional[str] = None, device: Optional[str] = None) -> Handle:
    """Send rows ``splits[j]`` of the first dimension to set rank j; the result is (rows
    received, counts received from each rank). Without splits the rows divide evenly."""
    n = len(process_sets.ranks_of(process_set))
    problem, counts = _alltoall_splits(array, splits, n)
    return Handle(submit("alltoall", [array], process_set, name, dtype and [dtype],
                         device and [device], problem, side=[counts]))


def _alltoall_splits(array: np.ndarray, splits: Optional[Sequence[int]],
                     n: int) -> tuple[str, np.ndarray]:
    rows = array.shape[0] if isinstance(array, np.ndarray) and array.ndim else 0
    if splits is None:
        if rows % n:
            return (f"without splits the first dimension ({rows}) must divide by the number "
                    f"of ranks ({n})"), np.zeros(0, np.int64)
        return "", np.full(n, rows // n, np.int64)
    given = np.asarray(splits)
    if given.dtype.kind not in "iu":
        return f"splits must be integers, got dtype {given.dtype}", np.zeros(0, np.int64)
    counts = given.astype(np.int64).reshape(-1)
    if counts.size != n or (counts < 0).any() or counts.sum() > rows:
        return (f"splits {counts.tolist()} must be {n} non-negative counts summing to at most "
                f"the first dimension ({rows})"), counts
    return "", counts


def grouped_reducescatter_async(arrays: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                name: Optional[str] = None,
                                process_set: ProcessSet = global_process_set,
                                dtypes: Optional[Sequence[str]] = None,
                                devices: Optional[Sequence[str]] = None) -> Handle:
    """Reduce across the set; set rank r keeps its rows of the first dimension (Horovod's
    split: the first ``rows % size`` ranks get one more)."""
    op = ReduceOp(op)
    problem = _reduction_problem(arrays, op)
    if not problem and any(isinstance(a, np.ndarray) and a.ndim == 0 for a in arrays):
        problem = "cannot scatter a 0-d (scalar) tensor: it needs a first dimension"
    error = HorovodInternalError if op == ReduceOp.Adasum else SgpValueError  # as Horovod's
    return Handle(submit("reducescatter", list(arrays), process_set, name, dtypes, devices,
                         problem, error, op=int(op), prescale=float(prescale_factor),
                         postscale=float(postscale_factor)))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the set has reached its barrier."""
    Handle(submit("barrier", None, process_set, None)).wait()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set,
                     dumps: Callable[[Any], bytes] = pickle.dumps,
                     loads: Callable[[bytes], Any] = pickle.loads) -> Any:
    """Root's object on every rank (its size, then its bytes: two broadcasts). Unnamed, it
    takes the set's next unnamed-op name (Horovod names it by the object's type, which hangs
    when root passes a dict and the others None)."""
    base = name or process_sets.controller(process_set).next_name()
    me = place.rank()
    payload = np.frombuffer(dumps(obj), np.uint8) if me == root_rank else None
    size = np.array([0 if payload is None else payload.size], np.int64)
    size = grouped_broadcast_async([size], root_rank, f"{base}.sz", process_set).wait()[0]
    if payload is None:
        payload = np.empty(int(size[0]), np.uint8)
    payload = grouped_broadcast_async([payload], root_rank, f"{base}.t", process_set).wait()[0]
    return loads(payload.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set,
                     dumps: Callable[[Any], bytes] = pickle.dumps,
                     loads: Callable[[bytes], Any] = pickle.loads) -> list:
    """Every rank's object, in set-rank order (sizes, then bytes: two allgathers)."""
    base = name or process_sets.controller(process_set).next_name()
    payload = np.frombuffer(dumps(obj), np.uint8)
    sizes = grouped_allgather_async([np.array([payload.size], np.int64)], f"{base}.sz",
                                    process_set).wait()[0]
    data = grouped_allgather_async([payload], f"{base}.t", process_set).wait()[0]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [loads(data[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]

