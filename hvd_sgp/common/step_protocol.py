"""The step protocol between a framework adapter and the engine, and its types.

Once per optimizer step, on every rank, in this order:

    plan = engine.begin_step(optimizer_state)   # schedule switch, if one is due
    if plan.reduce: engine.reduce_gradients(flat_grads)   # pre-scaled by 1 / plan.ranks
    ...the adapter's local optimizer step...
    engine.end_step(lr)                         # this stage's exchange

begin_step may be left out by an adapter that has no gradients to reduce: end_step then
begins the step itself (engine.GossipEngine.end_step). Gradient buffers end with one spare
element, as parameter buffers end with the weight: the engine writes this rank's share of the
sum there, so that the average stays an average of the ranks that contributed when some have
joined (hvd.join(): they serve with zeros).

Every operation on the buffers runs inside the adapter's ``BufferAccess``, which makes the
buffers hold the framework's current parameters before and writes them back after (a copy for
staged device tensors and TF variables; nothing where the buffers are the parameters' memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class BufferAccess(Protocol):
    """How the engine reaches the parameters: ``run(action)`` runs ``action`` while the
    buffers hold the framework's current parameters, and writes the buffers back after."""

    def run(self, action: Callable[[], T]) -> T: ...


class DirectAccess:
    """The buffers are the parameters' own memory (numpy views, CUDA-aware device tensors)."""

    def run(self, action: Callable[[], T]) -> T:
        return action()


@dataclass(frozen=True)
class StepPlan:
    """What the coming step does, as begin_step decided it."""

    mode: str  # the exchange after the local step: "sgp", "dpsgd" or "allreduce"
    reduce: bool  # gradients must be summed first (over the world in allreduce, else the node)
    entered_allreduce: bool  # switched into AllReduce SGD: parameters and state were averaged
    ranks: int  # how many ranks reduce_gradients sums (1 without a reduction)
