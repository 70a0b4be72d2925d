"""Local steps and outer optimizers: which steps communicate, and the step at each sync.

``local_steps = H`` (Local SGD): the stage's exchange runs only after every H-th local step;
SGP gossips then, and ``mode='allreduce'`` averages the model exactly instead of averaging
every step's gradients.

``outer_optimizer`` (DiLoCo; outer_steps.py): at every H-th step the averaged model x and the
model x0 of the previous sync (the anchor) give the pseudo-gradient d = x0 - x; the outer step
moves x0 by it and the model becomes x0. The average is exact in ``mode='allreduce'`` (DiLoCo:
every rank then takes the same outer step) or one PushSum round in ``mode='sgp'`` (gossip
DiLoCo): each node applies the step to its de-biased mix with its own anchor and momentum,
and leaves its PushSum weight as it is, so the weights still sum to n exactly. Nothing is
exchanged in between.

``slowmo = beta`` with ``slowmo_lr = alpha`` (SlowMo; Wang, Tantia, Ballas, Rabbat, ICLR 2020)
is the preset ``heavyball:alpha:beta`` scaled by the inner lr (outer_steps.MomentumStep),
with SGP gossiping every step and an exact average before each outer step.

The first sync only records x0, since ranks may not start from one model. x0 and the outer
step's state (momentum) are part of the optimizer's checkpointed state; a repair (a lost
rank) starts them afresh, since the fold replaces every model by the survivors' average.
Framework-free: it works on the engine's flat buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from hvd_sgp.common.choco import host_view
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.outer_steps import MomentumStep, OuterStep, parse


class OuterLoop:
    """When a step communicates, and the outer optimizer's state of one optimizer."""

    def __init__(self, local_steps: int = 1, slowmo: Optional[float] = None,
                 slowmo_lr: float = 1.0,
                 outer_optimizer: Union[str, OuterStep, None] = None):
        if local_steps < 1:
            raise SgpValueError(f"local_steps must be >= 1, got {local_steps}")
        if slowmo is not None and outer_optimizer is not None:
            raise SgpValueError("slowmo and outer_optimizer both name an outer step; SlowMo is "
                                f"outer_optimizer='heavyball:{slowmo_lr:g}:{slowmo:g}' with "
                                "gossip at every step: give one of them")
        self.period = int(local_steps)
        self.gossips_between = slowmo is not None  # SlowMo: SGP every step, exact average
        self.step: Optional[OuterStep] = (
            MomentumStep(slowmo_lr, slowmo, scaled=True) if slowmo is not None
            else parse(outer_optimizer) if isinstance(outer_optimizer, str) else outer_optimizer)
        self.anchor: Optional[list[np.ndarray]] = None

    def exchanges(self, step: int) -> bool:
        """Whether step number ``step`` (counted from 1) ends with the stage's exchange."""
        return self.gossips_between or step % self.period == 0

    def rounds(self, steps: int) -> int:
        """Exchanges in the first ``steps`` steps (a mixer's iteration number)."""
        return steps if self.gossips_between else steps // self.period

    def averages_gradients(self, mode: str) -> bool:
        """AllReduce SGD proper: every step's gradients averaged over the world."""
        return mode == "allreduce" and self.period == 1

    def synchronizes(self, step: int, mode: str) -> bool:
        """Whether step ``step`` ends with an exact average of the model."""
        exact = self.gossips_between or (mode == "allreduce" and self.period > 1)
        return exact and step % self.period == 0

    def steps_outer(self, step: int) -> bool:
        """Whether step ``step`` ends with the outer step (after its average or gossip)."""
        return self.step is not None and step % self.period == 0

    def update(self, buffers: Sequence, lr: float) -> None:
        """The outer step on the averaged buffers' de-biased parameters (the weights stay)."""
        if self.step is None:
            return
        models = [host_view(b)[:-1] for b in buffers]
        if self.anchor is None:
            self.anchor = [m.copy() for m in models]
            return
        self.step.apply(self.anchor, [x0 - x for x, x0 in zip(models, self.anchor)], lr)
        for x, x0 in zip(models, self.anchor):
            x[...] = x0

    def state(self) -> Optional[dict]:
        if self.anchor is None:
            return None
        return {"anchor": [x0.copy() for x0 in self.anchor], **self.step.state()}

    def load_state(self, state: Optional[dict]) -> None:
        """Restore ``state()``; None starts afresh (also after a repair)."""
        if self.step is None:
            return
        self.anchor = None if state is None else [np.array(a) for a in state["anchor"]]
        self.step.load_state({} if state is None else state)
