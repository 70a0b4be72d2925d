"""Communication schedules: which exchange runs at each epoch or step (the paper's hybrids).

Grammar of ``HVD_SGP_SCHEDULE`` / ``schedule="..."``: comma-separated ``START:MODE`` items.
START is an epoch number, or a step number with an ``s`` suffix (``500s``). MODE is
``allreduce``, ``dpsgd``, ``sgp`` or ``sgpK`` (K out-peers), ``osgp`` or ``osgpK`` (Overlap SGP).
The first item starts at 0; later ones start later. Examples::

    0:allreduce,30:sgp2,60:sgp1     exact AllReduce for 30 epochs, then 2-peer, then 1-peer SGP
    0:sgp2,1000s:osgp1              2-peer SGP for 1000 steps, then 1-peer Overlap SGP

A Python list of ``(start, mode, peers)`` or ``(start, mode, peers, "step")`` tuples also works.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

from hvd_sgp.common.errors import ScheduleError

_ITEM = re.compile(r"^\s*(\d+)(s?)\s*:\s*(allreduce|dpsgd|sgp|osgp)(\d*)\s*$")


@dataclass(frozen=True)
class Stage:
    start: int
    unit: str  # "epoch" or "step"
    mode: str  # "allreduce", "dpsgd" or "sgp"
    peers: int
    overlap: bool

    def active(self, epoch: int, step: int) -> bool:
        return (epoch if self.unit == "epoch" else step) >= self.start


def parse(spec: Union[str, Sequence[tuple]]) -> list[Stage]:
    """Stages from a schedule string or list; clear errors for anything else."""
    if isinstance(spec, str):
        stages = []
        for item in spec.split(","):
            match = _ITEM.match(item)
            if not match:
                raise ScheduleError(
                    f"schedule item {item.strip()!r} in {spec!r} is not START:MODE, e.g. "
                    "'0:allreduce,30:sgp2,60:sgp1' (START an epoch, or a step with suffix s; "
                    "MODE allreduce, dpsgd, sgpK or osgpK)")
            start, step, mode, peers = match.groups()
            stages.append(Stage(int(start), "step" if step else "epoch",
                                "sgp" if mode == "osgp" else mode, int(peers or 1),
                                mode == "osgp"))
    else:
        stages = [_from_tuple(entry) for entry in spec]
    if not stages or stages[0].start != 0:
        raise ScheduleError(f"schedule {spec!r} must begin with a stage at 0")
    for unit in ("epoch", "step"):
        starts = [s.start for s in stages if s.unit == unit]
        if starts != sorted(starts) or len(set(starts)) != len(starts):
            raise ScheduleError(f"schedule {spec!r}: {unit} starts must increase")
    for stage in stages:
        if stage.peers < 1:
            raise ScheduleError(f"schedule {spec!r}: peers must be >= 1")
    return stages


def _from_tuple(entry) -> Stage:
    try:
        start, mode, peers, *unit = entry
        overlap = mode == "osgp"
        mode = "sgp" if overlap else mode
        if mode not in ("allreduce", "dpsgd", "sgp") or len(unit) > 1:
            raise ValueError
        return Stage(int(start), unit[0] if unit else "epoch", mode, int(peers), overlap)
    except (TypeError, ValueError):
        raise ScheduleError(f"schedule entry {entry!r} is not (start, mode, peers[, 'step'|"
                            "'epoch']) with mode allreduce, dpsgd, sgp or osgp") from None


def current(stages: Sequence[Stage], epoch: int, step: int) -> Stage:
    """The last stage, in list order, whose start has been reached."""
    chosen = stages[0]
    for stage in stages:
        if stage.active(epoch, step):
            chosen = stage
    return chosen
