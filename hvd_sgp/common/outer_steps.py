"""Outer optimizers: what moves the model at a sync, given the pseudo-gradient.

Every ``local_steps`` steps the model x0 of the previous sync (the anchor) and the averaged
model x give the pseudo-gradient d = x0 - x; an ``OuterStep`` moves the anchor by it in place,
and the anchor becomes the model (outer.py). Numpy only (no MPI, no framework), so the options
table can name the presets and the simulator runs them:

    diloco             Nesterov SGD, lr 0.7, momentum 0.9 (DiLoCo, arXiv 2311.08105)
    nesterov:LR:MU     Nesterov SGD (torch's form: u <- MU u + d, x0 <- x0 - LR (d + MU u))
    heavyball:LR:MU    heavy-ball SGD (u <- MU u + d, x0 <- x0 - LR u)
    sgd:LR             x0 <- x0 - LR d (LR = 1: the averaged model itself, plain Local SGD)

SlowMo (``slowmo=beta``, ``slowmo_lr=alpha``) is heavy-ball with its pseudo-gradient divided
by the inner learning rate and its step multiplied by it (``scaled``), as in the paper. A
framework adapter may add its own kind (torch: any optimizer factory, torch/optimizer.py;
Keras: an optimizer or a factory, tensorflow/outer.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hvd_sgp.common.errors import OptionError

PRESETS = {"diloco": ("nesterov", 0.7, 0.9)}
KINDS = ("nesterov", "heavyball", "sgd")
# Elements per pass of MomentumStep: its temporaries stay 4 MB, which malloc reuses, where a
# model-sized temporary is fresh memory at every sync, page-faulted in again (measured: 0.3-1
# CPU s per 100 MB on this machine, more than the arithmetic).
BLOCK = 1 << 20


class OuterStep:
    """Moves the anchors by the pseudo-gradients; its state is checkpointed. ``repr`` must be
    the same on every rank (the ranks compare their options)."""

    def apply(self, anchors: Sequence[np.ndarray], pseudo: Sequence[np.ndarray],
              lr: float) -> None:
        """``anchors[i] -= step(pseudo[i])`` in place; ``lr``: the inner learning rate.
        ``pseudo`` is the caller's scratch: a step may overwrite it."""
        raise NotImplementedError

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        """Restore ``state()`` (an empty dict: start afresh)."""

    def reset(self) -> None:
        self.load_state({})


class MomentumStep(OuterStep):
    """SGD with heavy-ball or Nesterov momentum over the flat buffers (momentum 0: plain SGD).
    ``scaled`` (SlowMo): the pseudo-gradient is divided by the inner lr, the step multiplied."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 scaled: bool = False, name: Optional[str] = None):
        if not lr > 0 or not 0 <= momentum <= 1:
            raise OptionError(f"an outer step needs lr > 0 and momentum in [0, 1], got lr={lr}, "
                              f"momentum={momentum}")
        self.lr, self.momentum, self.nesterov, self.scaled = lr, momentum, nesterov, scaled
        self.name = name
        self.buffers: Optional[list[np.ndarray]] = None

    def apply(self, anchors: Sequence[np.ndarray], pseudo: Sequence[np.ndarray],
              lr: float) -> None:
        rate = (lr if lr > 0 else 1.0) if self.scaled else 1.0
        if self.buffers is None:
            self.buffers = [np.zeros_like(a) for a in anchors]
        for x0, d, u in zip(anchors, pseudo, self.buffers):
            for start in range(0, x0.size, BLOCK):
                block = slice(start, start + BLOCK)
                g, v = d[block], u[block]
                if self.scaled:
                    g /= rate
                v *= self.momentum
                v += g
                if self.nesterov:  # g + momentum v, in g's place (the same sum, to the bit)
                    g += self.momentum * v
                else:
                    g[...] = v
                g *= self.lr * rate
                x0[block] -= g

    def state(self) -> dict:
        return {} if self.buffers is None else {"momentum": [u.copy() for u in self.buffers]}

    def load_state(self, state: dict) -> None:
        momentum = state.get("momentum")
        self.buffers = None if momentum is None else [np.array(u) for u in momentum]

    def __repr__(self) -> str:
        kind = "nesterov" if self.nesterov else "heavyball" if self.momentum else "sgd"
        return self.name or f"{kind}:{self.lr:g}:{self.momentum:g}" + (
            " scaled" if self.scaled else "")


def parse(spec: str, source: str = "outer_optimizer") -> MomentumStep:
    """The outer step a spec names ('diloco', 'nesterov:0.7:0.9', 'heavyball:1:0.5',
    'sgd:1'); an OptionError naming ``source`` otherwise."""
    text = spec.strip().lower()
    kind, *numbers = PRESETS.get(text, text.split(":"))
    wanted = 1 if kind == "sgd" else 2
    try:
        values = [float(v) for v in numbers]
    except ValueError:
        values = []
    if kind not in KINDS or len(values) != wanted:
        raise OptionError(f"{source}={spec!r} is unknown; choose diloco, nesterov:LR:MOMENTUM, "
                          "heavyball:LR:MOMENTUM or sgd:LR")
    lr, momentum = values[0], values[1] if wanted == 2 else 0.0
    if not lr > 0 or not 0 <= momentum <= 1:
        raise OptionError(f"{source}={spec!r} needs LR > 0 and MOMENTUM in [0, 1]")
    return MomentumStep(lr, momentum, nesterov=kind == "nesterov",
                        name=text if text in PRESETS else None)
