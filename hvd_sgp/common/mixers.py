"""Which mixer gossips a buffer: one decision for the engine and the simulator alike.

A mixer is its codec part (what a message carries) with a timing part (when it travels):

- codec parts: exact and 16-bit codecs push the parameters themselves (pushsum.PushSumMixer);
  random-k gossips exactly on shared random entries (sparse.SparseMixer; with a weight per
  run where weights move: Overlap SGP, irregular graphs); the other lossy codecs gossip
  compressed differences against public copies (choco.ChocoMixer);
- timing parts: synchronous (timing.Synchronous) or Overlap SGP with a bounded delay
  (overlap.Overlap, with the copy-free push at tau = 1 where the codec part allows it).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvd_sgp.common.choco import ChocoMixer
from hvd_sgp.common.codecs import Codec, RandomKCodec, codec as make_codec
from hvd_sgp.common.overlap import Overlap
from hvd_sgp.common.pushsum import Part, PushSumMixer, Slot
from hvd_sgp.common.sparse import SparseMixer
from hvd_sgp.common.timing import Synchronous
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport_protocol import ProgressEngine, Transport


def feeds_back(codec: "str | Codec") -> bool:
    """Whether ``error_feedback`` changes how ``codec`` gossips: compressed PushSum drops what
    int8 and top-k leave out (and sends it later with feedback); random-k gossip drops
    nothing."""
    codec = make_codec(codec)
    return codec.differential and not isinstance(codec, RandomKCodec)


def build(buffer, topology: Topology, transport: Transport, *,
          shard: Optional[Callable[[Any], Part]] = None, push_sum: bool = True,
          codec: "str | Codec | None" = None, progress: Optional[ProgressEngine] = None,
          max_delay: int = 1, consensus_step: Optional[float] = None,
          error_feedback: bool = True, in_place: bool = False,
          compressed: Optional[bool] = None, slot: Optional[Slot] = None) -> PushSumMixer:
    """The mixer of one buffer: Overlap SGP when a ``progress`` engine is given (``in_place``:
    its copy-free push at tau = 1, where the codec part allows it). ``compressed`` forces
    compressed PushSum (True) or naive pushes of the encoding (False, the drift it causes)
    instead of the codec's own choice (None). ``slot``: the storage of the mixer this one
    succeeds (a repair's, a restore's), reused where it fits."""
    codec = make_codec(codec)
    timing = (Synchronous() if progress is None
              else Overlap(progress, max_delay=max_delay, in_place=in_place))
    if compressed is None and isinstance(codec, RandomKCodec):
        return SparseMixer(buffer, topology, transport, shard, push_sum, codec, timing=timing,
                           slot=slot)
    if codec.differential if compressed is None else compressed:
        return ChocoMixer(buffer, topology, transport, shard, push_sum, codec,
                          step=consensus_step, error_feedback=error_feedback, timing=timing,
                          slot=slot)
    return PushSumMixer(buffer, topology, transport, shard, push_sum, codec, timing=timing,
                        slot=slot)
