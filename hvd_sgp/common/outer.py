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

``outer_fragments = P`` (Streaming DiLoCo, arXiv 2501.18512): the parameters of every buffer
are cut into P contiguous fragments, and fragment p syncs (one PushSum round, or an exact
average) and takes its outer step at the steps congruent to p*H//P modulo H, so each step
sends at most one fragment: peak bytes per step fall P-fold while each fragment still syncs
every H steps. Over gossip every fragment is a PushSum buffer of its own, with its own weight
(copied in from the model before its round and back after it), so each fragment's mass is
conserved exactly, as the whole buffer's is; each fragment has its own outer-step state.

With Overlap SGP (``overlap=True`` over gossip; plain Local SGD too, as the identity outer
step) a fragment's round runs beside computation: it starts at the fragment's step (a copy of
the fragment, pushed without blocking) and its outer step lands ``delay = min(max_delay, H -
1)`` steps later, after the local steps taken meanwhile. Those are kept: the fragment becomes
x0' + (x_now - x_sent), the outer step's new anchor plus the local progress since the round
began, and that progress counts in the next pseudo-gradient (Streaming DiLoCo's overlapped
outer step, arXiv 2501.18512, section 2.3, with the local progress kept rather than mixed by
alpha). Even one fragment then gossips a PushSum buffer of its own, so the model is free for
the local steps. A drain, a stage switch, an exact average or a checkpoint's settled state
lands a round early (with the progress so far); a restore or a repair drops it, as it drops the
messages in flight.

The first sync only records x0, since ranks may not start from one model. x0 and the outer
step's state (momentum) are part of the optimizer's checkpointed state; a repair (a lost
rank) starts them afresh, since the fold replaces every model by the survivors' average.
Fragments' PushSum weights start again at 1 after a restore or a repair (exact where the graph
keeps weights at 1, as the default exponential graph does). Framework-free: it works on the
engine's flat buffers.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence, Union

import numpy as np

from hvd_sgp.common.arrays import host_view
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.outer_steps import MomentumStep, OuterStep, parse
from hvd_sgp.common.pushsum import allocate

Average = Callable[[np.ndarray, Optional[np.ndarray]], None]  # exact_average(buf, weights)


class OuterLoop:
    """When a step communicates, and the outer optimizer's state of one optimizer."""

    def __init__(self, local_steps: int = 1, slowmo: Optional[float] = None,
                 slowmo_lr: float = 1.0,
                 outer_optimizer: Union[str, OuterStep, None] = None, fragments: int = 1):
        if local_steps < 1:
            raise SgpValueError(f"local_steps must be >= 1, got {local_steps}")
        if not 1 <= fragments <= local_steps:
            raise SgpValueError(f"outer_fragments={fragments} needs 1 <= outer_fragments <= "
                                f"local_steps (= {local_steps}): each fragment syncs at its "
                                "own step of every local_steps")
        if fragments > 1 and slowmo is not None:
            raise SgpValueError("outer_fragments > 1 streams the outer step of outer_optimizer; "
                                "SlowMo gossips every step: use outer_optimizer='heavyball:"
                                "LR:MU' instead of slowmo")
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
        self._pseudo: list[np.ndarray] = []  # the pseudo-gradient's scratch, one per buffer
        self.fragments = int(fragments)
        if self.fragments > 1:
            self.step = self.step or parse("sgd:1")  # plain streaming Local SGD
        self.steps = [self.step] + [copy.deepcopy(self.step) for _ in range(self.fragments - 1)]
        self.delay = 0  # steps an outer step waits for its round (Overlap SGP; see defer)
        self._rounds: dict[int, int] = {}  # fragment -> step its delayed round began
        self._landing: list[int] = []  # the fragments whose outer step is taken now
        self.offsets = [p * self.period // self.fragments for p in range(self.fragments)]
        self.average: Optional[Average] = None  # the engine's exact average of one buffer
        self._layout: list[tuple[int, int, int, int]] = []  # (fragment, buffer, start, stop)
        self._pieces: list[np.ndarray] = []  # a PushSum buffer per layout entry
        self._views: Optional[list[list[np.ndarray]]] = None  # each fragment's anchor slices
        self._started: set[int] = set()  # fragments whose anchor is recorded
        self._sizes: list[int] = []  # the buffers' parameter counts the layout was cut for
        self._gossiped = False  # they went through gossip mixers (else: an exact average)

    def defer(self, overlapped: bool, max_delay: int) -> None:
        """For the stage's mixers about to be built: an overlapped gossip stage delays each
        outer step by min(max_delay, H - 1) steps (none where H = 1, or under SlowMo). Plain
        Local SGD's sync becomes the identity outer step 'sgd:1' (the mix), so that it too
        lands later, its progress kept."""
        delays = overlapped and self.period > 1 and not self.gossips_between
        self.delay = min(max_delay, self.period - 1) if delays else 0
        if self.delay and self.step is None:
            self.step = parse("sgd:1")
            self.steps = [self.step]

    @property
    def streamed(self) -> bool:
        """Whether the stage gossips per-fragment PushSum buffers (not the model's own)."""
        return self.fragments > 1 or self.delay > 0

    def exchanges(self, step: int) -> bool:
        """Whether step number ``step`` (counted from 1) ends with the stage's exchange."""
        if self.streamed:
            return bool(self.due(step))
        return self.gossips_between or step % self.period == 0

    def due(self, step: int) -> list[int]:
        """The fragments that sync at step ``step``: those whose offset is ``step`` mod H."""
        return [p for p, offset in enumerate(self.offsets) if step % self.period == offset]

    def phase_ends(self, step: int, buffers: Sequence) -> list[tuple[int, slice]]:
        """The (buffer, parameter slice) pairs whose local phase ends with step ``step``'s
        exchange: every buffer, or with fragments the due fragments' slices (local_update.py)."""
        if not self.streamed:
            return [(i, slice(None)) for i in range(len(buffers))] if self.exchanges(step) else []
        self._cut(buffers)
        due = self.due(step)
        return [(i, slice(start, stop)) for p, i, start, stop in self._layout if p in due]

    def gossip_buffers(self, buffers: Sequence) -> list:
        """What the stage's mixers gossip: the buffers themselves, or with fragments one
        PushSum buffer per (fragment, buffer), kept across stages (their weights with them)."""
        if not self.streamed:
            return list(buffers)
        self._cut(buffers)
        return list(self._pieces)

    def _cut(self, buffers: Sequence) -> None:
        """The fragments' layout and PushSum buffers (once per set of buffers)."""
        sizes = [len(host_view(b)) - 1 for b in buffers]
        if sizes == self._sizes:
            return
        self._sizes = sizes
        self._layout = [(p, i, int(edges[p]), int(edges[p + 1]))
                        for p in range(self.fragments) for i, size in enumerate(sizes)
                        for edges in [np.linspace(0, size, self.fragments + 1).round()]]
        self._pieces = [allocate(stop - start, host_view(buffers[i]).dtype)
                        for _, i, start, stop in self._layout]
        self._views = None

    def gossiping(self, mixers: Sequence, step: int, buffers: Sequence) -> list:
        """The mixers that exchange at step ``step``; with fragments, the due fragments'
        mixers, their buffers loaded from the model (their weights stay theirs; a delayed
        round also keeps what it sent, to find the local progress made meanwhile)."""
        if not self.streamed:
            return list(mixers) if self.exchanges(step) else []
        due, self._gossiped = self.due(step), bool(mixers)
        chosen = []
        sent = self._scratch([host_view(b)[:-1] for b in buffers]) if self.delay else None
        for k, (p, i, start, stop) in enumerate(self._layout if mixers else ()):
            if p in due:
                self._pieces[k][:-1] = host_view(buffers[i])[start:stop]
                if sent is not None:
                    sent[i][start:stop] = self._pieces[k][:-1]
                chosen.append(mixers[k])
        if self.delay and mixers:
            self._rounds.update((p, step) for p in due)
        else:
            self._landing = due
        return chosen

    def fold(self, buffers: Sequence, mixers: Sequence) -> bool:
        """With fragments gossiped, the exact average of every fragment by its own weight
        (or its mixer's entry weights), into the model; False: the engine folds the buffers."""
        if not self.streamed or not self._layout or len(mixers) != len(self._layout):
            return False
        for k, (_, i, start, stop) in enumerate(self._layout):
            piece, model = self._pieces[k], host_view(buffers[i])
            piece[:-1] = model[start:stop]
            self.average(piece, mixers[k].entry_weights())
            model[start:stop] = piece[:-1]
        return True

    def rounds(self, steps: int, fragment: int = 0) -> int:
        """Exchanges of ``fragment`` in the first ``steps`` steps (its mixers' iteration)."""
        if self.gossips_between:
            return steps
        offset = self.offsets[fragment]
        return (steps - offset) // self.period + (offset > 0)

    def set_rounds(self, mixers: Sequence, steps: int) -> None:
        """Every mixer at its iteration after ``steps`` steps (as on every other rank)."""
        fragments = [p for p, _, _, _ in self._layout] if self.streamed else []
        for k, mixer in enumerate(mixers):
            mixer.iteration = self.rounds(steps, fragments[k] if fragments else 0)

    def averages_gradients(self, mode: str) -> bool:
        """AllReduce SGD proper: every step's gradients averaged over the world."""
        return mode == "allreduce" and self.period == 1

    def synchronizes(self, step: int, mode: str) -> bool:
        """Whether step ``step`` ends with an exact average of the whole model (fragments
        average theirs in ``update``)."""
        exact = self.gossips_between or (mode == "allreduce" and self.period > 1)
        return exact and self.fragments == 1 and step % self.period == 0

    def steps_outer(self, step: int) -> bool:
        """Whether step ``step`` ends with an outer step (after its average or gossip, or with
        a delay, the rounds that began ``delay`` steps before: those land now)."""
        if self.delay:
            self._landing = [p for p, began in self._rounds.items() if began + self.delay <= step]
            return bool(self._landing)
        if self.fragments > 1:
            return bool(self.due(step))
        return self.step is not None and step % self.period == 0

    def settles(self) -> bool:
        """Whether a delayed round is under way; if so, its outer step is the next
        ``update`` (landing early, with the local progress so far)."""
        self._landing = list(self._rounds)
        return bool(self._landing)

    @property
    def pending(self) -> bool:
        """Whether a delayed round is under way (its outer step not yet taken)."""
        return bool(self._rounds)

    def landing_mixers(self, mixers: Sequence) -> list:
        """The mixers whose round the outer step about to be taken needs complete."""
        if not self.streamed:
            return list(mixers)
        return [m for m, (p, _, _, _) in zip(mixers, self._layout) if p in self._landing]

    def update(self, buffers: Sequence, lr: float) -> None:
        """The outer step on the averaged buffers' de-biased parameters (the weights stay)."""
        if self.step is None:
            return
        models = [host_view(b)[:-1] for b in buffers]
        if self.streamed:
            self._update_fragments(buffers, models, lr)
            return
        if self.anchor is None:
            self.anchor = [m.copy() for m in models]
            return
        self.step.apply(self.anchor, self._differences(models, self.anchor, range(len(models))),
                        lr)
        for x, x0 in zip(models, self.anchor):
            x[...] = x0

    def _scratch(self, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One array like each of ``like`` (the models), allocated once: no model-sized
        array at a sync."""
        if [len(d) for d in self._pseudo] != [len(a) for a in like]:
            self._pseudo = [np.empty_like(a) for a in like]
        return self._pseudo

    def _differences(self, models: Sequence[np.ndarray], anchors: Sequence[np.ndarray],
                     slots: Sequence) -> list[np.ndarray]:
        """x0 - x into the scratch (``slots``: each pair's place in it, an index or an
        (index, slice))."""
        scratch = self._scratch(self.anchor)
        out = []
        for x, x0, slot in zip(models, anchors, slots):
            i, part = slot if isinstance(slot, tuple) else (slot, slice(None))
            out.append(np.subtract(x0, x, out=scratch[i][part]))
        return out

    def _update_fragments(self, buffers: Sequence, models: list[np.ndarray], lr: float) -> None:
        """The landing fragments: each one's outer step on its mix (or exact average), from
        its anchor slices (a fragment's first sync records its anchor); the model's slices
        become the new anchor, plus the local progress since a delayed round began."""
        self._cut(buffers)
        if self.anchor is None:
            self.anchor, self._views = [m.copy() for m in models], None
        if self._views is None:  # fixed views: a framework's optimizer holds them
            self._views = [[self.anchor[i][start:stop] for q, i, start, stop in self._layout
                            if q == p] for p in range(self.fragments)]
        for p in self._landing:
            delayed = self._rounds.pop(p, None) is not None
            entries = [(k, i, slice(start, stop))
                       for k, (q, i, start, stop) in enumerate(self._layout) if q == p]
            for k, i, part in entries:
                piece = self._pieces[k]
                if not self._gossiped:  # mode='allreduce': this fragment's exact average
                    piece[:-1], piece[-1] = models[i][part], 1
                    self.average(piece, None)
                if delayed:  # the local progress since the round's copy was sent
                    np.subtract(models[i][part], self._pseudo[i][part], out=models[i][part])
            mixes = [self._pieces[k][:-1] for k, _, _ in entries]
            if p in self._started:
                slots = [(i, part) for _, i, part in entries]
                self.steps[p].apply(self._views[p],
                                    self._differences(mixes, self._views[p], slots), lr)
            else:
                for x, x0 in zip(mixes, self._views[p]):
                    x0[...] = x
                self._started.add(p)
            for (_, i, part), x0 in zip(entries, self._views[p]):
                if delayed:
                    models[i][part] += x0
                else:
                    models[i][part] = x0

    def state(self) -> Optional[dict]:
        if self.anchor is None:
            return None
        if self.streamed:
            return {"anchor": [x0.copy() for x0 in self.anchor], "started": sorted(self._started),
                    "fragments": [step.state() for step in self.steps]}
        return {"anchor": [x0.copy() for x0 in self.anchor], **self.step.state()}

    def load_state(self, state: Optional[dict]) -> None:
        """Restore ``state()``; None starts afresh (also after a repair). A delayed round
        under way is dropped, as the messages in flight are. One fragment's state loads
        whether or not it was saved streamed (overlap switched at the resume)."""
        if self.step is None:
            return
        self._rounds.clear()
        if state is not None and self.fragments == 1 and self.streamed != ("fragments" in state):
            state = ({"anchor": state["anchor"], **state["fragments"][0]} if not self.streamed
                     else {"anchor": state["anchor"], "started": [0],
                           "fragments": [{k: v for k, v in state.items() if k != "anchor"}]})
        self.anchor = None if state is None else [np.array(a) for a in state["anchor"]]
        if self.streamed:
            self._views = None
            self._started = set() if state is None else set(state["started"])
            for k, step in enumerate(self.steps):
                step.load_state({} if state is None else state["fragments"][k])
            for piece in self._pieces:  # restarted as the engine's buffers are: weight 1
                piece[-1] = 1
            return
        self.step.load_state({} if state is None else state)
