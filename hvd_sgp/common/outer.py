"""Local steps and SlowMo: how often the nodes communicate, and the slow outer update.

``local_steps = H`` (Local SGD): the stage's exchange runs only after every H-th local step;
SGP gossips then, and ``mode='allreduce'`` averages the model exactly instead of averaging
every step's gradients.

``slowmo = beta`` with ``slowmo_lr = alpha`` (SlowMo; Wang, Tantia, Ballas, Rabbat, ICLR 2020):
after every H-th step the model is averaged exactly and moved by a slow momentum,

    u <- beta u + (x0 - x) / lr,    x <- x0 - alpha lr u,    x0 <- x

where x0 is the model after the previous outer step and lr the base learning rate. Between
outer steps SGP gossips every step (``mode='sgp'``) or nothing happens (``mode='allreduce'``:
SlowMo on Local SGD). The first outer step only records x0, since ranks may not start from
one model. u and x0 (two model copies) are part of the optimizer's checkpointed state.
Framework-free: it works on the engine's flat buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hvd_sgp.common.choco import host_view
from hvd_sgp.common.errors import SgpValueError


class OuterLoop:
    """When a step communicates, and the SlowMo state of one optimizer."""

    def __init__(self, local_steps: int = 1, slowmo: Optional[float] = None,
                 slowmo_lr: float = 1.0):
        if local_steps < 1:
            raise SgpValueError(f"local_steps must be >= 1, got {local_steps}")
        self.period = int(local_steps)
        self.slowmo = slowmo
        self.slowmo_lr = float(slowmo_lr)
        self.momentum: Optional[list[np.ndarray]] = None
        self.anchor: Optional[list[np.ndarray]] = None

    def exchanges(self, step: int) -> bool:
        """Whether step number ``step`` (counted from 1) ends with the stage's exchange."""
        return self.slowmo is not None or step % self.period == 0

    def rounds(self, steps: int) -> int:
        """Exchanges in the first ``steps`` steps (a mixer's iteration number)."""
        return steps if self.slowmo is not None else steps // self.period

    def averages_gradients(self, mode: str) -> bool:
        """AllReduce SGD proper: every step's gradients averaged over the world."""
        return mode == "allreduce" and self.period == 1

    def synchronizes(self, step: int, mode: str) -> bool:
        """Whether step ``step`` ends with an exact average of the model (and SlowMo's update)."""
        outer = self.slowmo is not None or (mode == "allreduce" and self.period > 1)
        return outer and step % self.period == 0

    def update(self, buffers: Sequence, lr: float) -> None:
        """SlowMo's outer step on the exactly averaged buffers (identical on every rank)."""
        if self.slowmo is None:
            return
        models = [host_view(b)[:-1] for b in buffers]
        if self.anchor is None:
            self.anchor = [m.copy() for m in models]
            self.momentum = [np.zeros_like(m) for m in models]
            return
        rate = lr if lr > 0 else 1.0
        for x, x0, u in zip(models, self.anchor, self.momentum):
            u *= self.slowmo
            u += (x0 - x) / rate
            x0 -= (self.slowmo_lr * rate) * u
            x[...] = x0

    def state(self) -> Optional[dict]:
        if self.anchor is None:
            return None
        return {"momentum": [u.copy() for u in self.momentum],
                "anchor": [x0.copy() for x0 in self.anchor]}

    def load_state(self, state: Optional[dict]) -> None:
        if state is None:
            self.anchor = self.momentum = None
            return
        self.anchor = [np.array(a) for a in state["anchor"]]
        self.momentum = [np.array(u) for u in state["momentum"]]
