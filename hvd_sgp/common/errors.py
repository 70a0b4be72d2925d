"""Exceptions that name the rank they were raised on, so a log of N interleaved ranks stays
readable; ``error.rank`` holds it (None before init). Subclasses say what kind of input was
wrong, so callers and tests can tell them apart without reading the message."""
from __future__ import annotations

from typing import Callable, Optional

_rank_source: list = [lambda: None]  # runtime names the rank once it has one


def name_ranks_by(source: Callable[[], Optional[int]]) -> None:
    """Where errors and messages read the calling rank (runtime, at import: errors import
    nothing of hvd_sgp, so every module may import them)."""
    _rank_source[0] = source


def _rank() -> Optional[int]:
    return _rank_source[0]()


def on_rank(message: str) -> str:
    """Prefix a message with the calling rank."""
    rank = _rank()
    return f"hvd_sgp rank {'?' if rank is None else rank}: {message}"


class SgpError(RuntimeError):
    """A failure of the SGP machinery (communication, consistency, numerics)."""

    ag_pass_through = True  # TensorFlow's AutoGraph re-raises it as it is, not as StagingError

    def __init__(self, message: str):
        self.rank = _rank()
        super().__init__(on_rank(message))


class SgpValueError(ValueError):
    """A bad argument, topology, environment value or model, found before it can do harm."""

    ag_pass_through = True  # as SgpError's

    def __init__(self, message: str):
        self.rank = _rank()
        super().__init__(on_rank(message))


class OptionError(SgpValueError):
    """An SGP option (keyword, HVD_SGP_* variable or sgprun flag) or codec is invalid."""


class TopologyError(SgpValueError):
    """A graph that SGP cannot use: bad peers or weights, not strongly connected, wrong size."""


class ScheduleError(OptionError):
    """An exchange schedule that does not parse or does not start at 0."""


class ConsistencyError(SgpValueError):
    """Ranks disagree on what must be the same everywhere (parameters, options)."""


class PeerTimeoutError(SgpError):
    """A peer did not deliver within the timeout: it died, froze or runs a different program."""


class NotInitializedError(SgpValueError):
    """An hvd_sgp call that needs MPI came before init()."""

    def __init__(self) -> None:
        super().__init__("hvd_sgp has not been initialized; call hvd.init() first.")


class HorovodInternalError(SgpError):
    """A Horovod-API collective failed on every rank of its process set: the ranks disagreed
    on it, a rank had already joined, or a rank timed out (Horovod's class of the same name,
    so elastic scripts that catch it keep working)."""


class CollectiveTimeoutError(HorovodInternalError, PeerTimeoutError):
    """A Horovod-API collective waited past HVD_SGP_TIMEOUT for the ranks it names."""


class PeerLostError(HorovodInternalError):
    """A peer process failed or was excluded while this rank communicated with it (fault-
    tolerant mode): the survivors repair the world (hvd_sgp.common.recovery) and go on;
    ``hvd.elastic.run`` catches it, repairs and calls the training function again."""


class HostsUpdatedInterrupt(SgpError):
    """Horovod's elastic interrupt: the set of hosts changed (``skip_sync`` as in Horovod)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of hosts in the job has changed")
        self.skip_sync = skip_sync
