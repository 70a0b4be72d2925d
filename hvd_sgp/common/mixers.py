"""Which mixer gossips a buffer: one decision for the engine and the simulator alike.

- exact and 16-bit codecs push the parameters themselves (pushsum.py; overlap.py under
  Overlap SGP);
- random-k gossips exactly on shared random entries (sparse.py; with a weight per run where
  weights move: Overlap SGP, irregular graphs);
- the other lossy codecs gossip compressed differences against public copies (choco.py).
"""
from __future__ import annotations

from typing import Optional

from hvd_sgp.common.choco import ChocoMixer, ChocoOverlapMixer
from hvd_sgp.common.codecs import Codec, RandomKCodec, codec as make_codec
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.overlap import OverlapMixer
from hvd_sgp.common.pushsum import PushSumMixer
from hvd_sgp.common.sparse import SparseMixer, SparseOverlapMixer
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport import ProgressEngine, Transport


def feeds_back(codec: "str | Codec") -> bool:
    """Whether ``error_feedback`` changes how ``codec`` gossips: compressed PushSum drops what
    int8 and top-k leave out (and sends it later with feedback); random-k gossip drops
    nothing."""
    codec = make_codec(codec)
    return codec.differential and not isinstance(codec, RandomKCodec)


def build(buffer, topology: Topology, transport: Transport, *,
          local: Optional[MPI.Comm] = None, push_sum: bool = True,
          codec: "str | Codec | None" = None, progress: Optional[ProgressEngine] = None,
          max_delay: int = 1, consensus_step: Optional[float] = None,
          error_feedback: bool = True, in_place: bool = False,
          compressed: Optional[bool] = None) -> PushSumMixer:
    """The mixer of one buffer: Overlap SGP when a ``progress`` engine is given.
    ``compressed`` forces compressed PushSum (True) or naive pushes of the encoding (False,
    the drift it causes) instead of the codec's own choice (None)."""
    codec = make_codec(codec)
    choco = codec.differential if compressed is None else compressed
    if compressed is None and isinstance(codec, RandomKCodec):
        if progress is not None:
            return SparseOverlapMixer(buffer, topology, transport, progress, local, push_sum,
                                      codec, max_delay)
        return SparseMixer(buffer, topology, transport, local, push_sum, codec)
    extra = (dict(step=consensus_step, error_feedback=error_feedback) if choco
             else {"in_place": in_place} if progress is not None else {})
    if progress is not None:
        kind = ChocoOverlapMixer if choco else OverlapMixer
        return kind(buffer, topology, transport, progress, local, push_sum, codec, max_delay,
                    **extra)
    kind = ChocoMixer if choco else PushSumMixer
    return kind(buffer, topology, transport, local, push_sum, codec, **extra)
