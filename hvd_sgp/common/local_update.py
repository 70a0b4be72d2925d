"""What a local step may move: PushSum's numerator step, and uneven workers' sample shares.

**The numerator step.** The buffers hold the de-biased parameters z = x / w, and the adapter's
optimizer steps them. SGP (Assran et al., Algorithm 1) evaluates the gradient at z and steps the
numerator, x <- x - lr g, so z moves by the optimizer's update divided by w. Stepping z itself
would move the numerators by w times the update and weigh each node's gradients by its weight:
wherever the weights leave 1 (Overlap SGP's messages in flight, a graph that is not doubly
stochastic) the network would settle at a weighted, wrong optimum. So the update of a step
taken at weight w != 1 is divided by w (the update, not the gradient: Adam's step does not
scale with its gradient). At w = 1 exactly (synchronous gossip on the default graph, whose
weights are reset to 1) nothing is copied or touched.

**Uneven workers.** On a cluster of unlike machines the usual remedy is to give a slower rank
a smaller batch, so that every rank's step takes the same time and nobody waits at the
exchange. Its gradients then rest on fewer samples, and the models should mix in proportion
to the samples behind them, as one AllReduce over the global batch weighs them.
``samples_per_step=b`` (set on every rank, values free) asks for that:

- inside a node, and in AllReduce SGD over the world, each rank's gradient is scaled by its
  share of the group's mean samples before the exact sum, so the sum is the sample-weighted
  mean gradient (the global batch's gradient);
- across nodes, what the local steps moved the model since the node's last exchange (its local
  phase: one step in SGP, ``local_steps`` under Local SGD or an outer optimizer, a fragment's
  own phase when streaming) is scaled by the node's share of the nodes' mean samples just
  before the exchange, so the average the gossip converges to moves by the sample-weighted
  mean of the nodes' updates.

This is PushSum mass in proportion to samples, put where it cannot drift: the nodes' shares
sum to the number of nodes exactly, and the PushSum weights are left as they are (they still
sum to n, which the fold after a lost rank and the mass ledger rely on). The shares are
measured once per world (two small allreduces) and again after a repair. Framework-free: the
buffers are numpy arrays or a registered kit's tensors.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.mpi import MPI

Slices = Sequence[tuple[int, slice]]  # (buffer index, parameter slice) whose phase ends


class LocalUpdates:
    """The parameters before the current local step, this rank's sample shares, and what the
    local steps of the current phase moved (scaled by the node's share when it ends)."""

    def __init__(self, samples: Optional[int]):
        self.samples = samples
        self.in_node = 1.0  # this rank's samples / its node's mean per rank
        self.in_world = 1.0  # this rank's samples / the world's mean per rank
        self.node = 1.0  # this node's samples / the nodes' mean
        self._world: Optional[MPI.Comm] = None  # the world the shares were measured in
        self._before: list = []  # per buffer: the parameters before the current local step
        self._moved: list = []  # per buffer: what local steps moved it this phase
        self._taken = False  # _before holds the current step's start
        self._weights: list[float] = []  # per buffer: the weight the step is taken at, where
        # one is not 1 (else empty: nothing is divided)

    @property
    def weighs_samples(self) -> bool:
        return self.samples is not None

    @property
    def scales_phases(self) -> bool:
        """Whether the phases' updates are scaled (this node's samples are not the mean)."""
        return self.weighs_samples and self.node != 1.0

    def measure(self, world: MPI.Comm, local: MPI.Comm) -> None:
        """The shares, once per world (a collective: every rank of ``world`` calls it)."""
        if not self.weighs_samples or world is self._world:
            return
        totals = np.array([self.samples, local.Get_rank() == 0], dtype=np.float64)
        world.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        node = np.array([self.samples], dtype=np.float64)
        local.Allreduce(MPI.IN_PLACE, node, op=MPI.SUM)
        everyone, nodes = totals
        self.in_world = self.samples * world.Get_size() / everyone
        self.in_node = self.samples * local.Get_size() / node[0]
        self.node = node[0] * nodes / everyone
        self._world = world

    def forget(self) -> None:
        """The world changed (a repair, a grow): measure again, start the phase afresh."""
        self._world = None
        self.restart()

    def restart(self) -> None:
        """The parameters were replaced (a restore, a repair): no local update yet."""
        self._taken = False
        for moved in self._moved:
            moved[...] = 0

    def before_local_step(self, buffers: Sequence, weights_move: bool = True) -> None:
        """Remember the parameters the local step starts from, where it will be scaled.
        ``weights_move`` off: every weight is 1 (the mixers reset it), or the mixers keep a
        weight per entry (random-k where weights move), whose step is left as it is (not
        done: dividing entry by entry)."""
        weights = [float(b[-1]) for b in buffers] if weights_move else []
        self._weights = weights if any(w != 1.0 for w in weights) else []
        self._taken = self.scales_phases or bool(self._weights)
        if not self._taken:
            return
        if len(self._before) != len(buffers):
            self._before = [kit_for(b).empty(b, (len(b) - 1,)) for b in buffers]
        if self.scales_phases and len(self._moved) != len(buffers):
            self._moved = [kit_for(b).empty(b, (len(b) - 1,)) for b in buffers]
            for moved in self._moved:
                moved[...] = 0
        for before, buf in zip(self._before, buffers):
            before[...] = buf[:-1]

    def after_local_step(self, buffers: Sequence) -> None:
        """The step's update divided by the weight it was taken at, and added to the phase's."""
        if not self._taken:
            return
        self._taken = False
        for i, (before, buf) in enumerate(zip(self._before, buffers)):
            if self._weights and self._weights[i] != 1.0:  # z = before + (z - before) / w
                kit_for(buf).lerp(buf[:-1], before, 1.0 - 1.0 / self._weights[i])
            if self.scales_phases:
                self._moved[i] += buf[:-1]
                self._moved[i] -= before

    def end_phase(self, buffers: Sequence, slices: Slices) -> None:
        """Before the exchange that ends these slices' phase: their update scaled by the
        node's share, and their phase started over (called where ``scales_phases``)."""
        if len(self._moved) != len(buffers):
            return
        for i, part in slices:
            moved = self._moved[i][part]
            buffers[i][:-1][part] += (self.node - 1.0) * moved
            moved[...] = 0
