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
