"""SGP's figures as TensorBoard scalars, beside a script's own SummaryWriter.

Horovod's torch scripts open a writer on rank 0 only
(``log_writer = SummaryWriter(log_dir) if hvd.rank() == 0 else None``); pass it as it is:

    log_sgp_metrics(log_writer, optimizer, step)   # on every rank

writes ``sgp_weight/rank<r>``, ``sgp_wait_seconds/rank<r>``, ``sgp_bytes_sent/rank<r>`` and,
with ``consensus=True``, ``sgp_deviation/rank<r>``, ``sgp_elastic/rank<r>`` and
``sgp_distance`` (names from hvd_sgp.common.telemetry). Needs the ``tensorboard`` package
(``pip install hvd_sgp[tensorboard]``) for torch.utils.tensorboard.
"""
from __future__ import annotations

from typing import Any, Optional

from hvd_sgp.common.errors import SgpValueError


def log_sgp_metrics(writer: Optional[Any], optimizer: Any, step: int,
                    consensus: bool = True) -> dict:
    """Gather every rank's SGP figures (a collective: call it on every rank) and add them as
    scalars at ``step`` to ``writer`` where it is not None (rank 0's SummaryWriter). Returns
    the figures written."""
    if not hasattr(optimizer, "gathered_sgp_scalars"):
        raise SgpValueError(f"log_sgp_metrics needs an hvd_sgp DistributedOptimizer, got "
                            f"{type(optimizer).__name__}")
    figures = optimizer.gathered_sgp_scalars(consensus)
    if writer is not None:
        for name, value in figures.items():
            writer.add_scalar(name, value, step)
        writer.flush()
    return figures
