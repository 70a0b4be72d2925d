"""Exceptions that name the rank they were raised on, so a log of N interleaved ranks stays readable."""
from __future__ import annotations


def _rank_label() -> str:
    # Imported lazily: runtime imports this module.
    from hvd_sgp.common import runtime

    return f"rank {runtime.rank()}" if runtime.is_initialized() else "rank ?"


def on_rank(message: str) -> str:
    """Prefix a message with the calling rank."""
    return f"hvd_sgp {_rank_label()}: {message}"


class SgpError(RuntimeError):
    """A failure of the SGP machinery (communication, consistency, numerics)."""

    def __init__(self, message: str):
        super().__init__(on_rank(message))


class SgpValueError(ValueError):
    """A bad argument, topology, environment value or model, found before it can do harm."""

    def __init__(self, message: str):
        super().__init__(on_rank(message))


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


class HostsUpdatedInterrupt(SgpError):
    """Horovod's elastic interrupt: the set of hosts changed (``skip_sync`` as in Horovod)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of hosts in the job has changed")
        self.skip_sync = skip_sync
