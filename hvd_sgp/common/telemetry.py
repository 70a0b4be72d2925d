"""What the gossip is doing: consensus measures, a metrics log and a Chrome-trace timeline.

Cheap figures (weight, seconds waited, bytes sent) are counters kept by the transport. The
consensus measures cost one allreduce and run only when asked for (or every N steps with
``HVD_SGP_METRICS``). The timeline (``HVD_SGP_TIMELINE`` or ``HOROVOD_TIMELINE``) records each
rank's compute, send/receive and wait spans (and a CYCLE_START mark per step with
``HOROVOD_TIMELINE_MARK_CYCLES=1``); each rank writes its own file while it runs and
rank 0 merges them into the named file at shutdown, one row per rank (open it in Perfetto).
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # telemetry is read by tools and the simulator, which do not start MPI
    from mpi4py import MPI

if TYPE_CHECKING:
    from hvd_sgp.common.options import SgpOptions


def consensus(params: np.ndarray, comm: MPI.Comm) -> dict:
    """One allreduce of [z_i, ||z_i||^2]: the network mean, this rank's deviation
    ||z_i - mean||, and the consensus distance sqrt(mean_i ||z_i - mean||^2)."""
    values = np.asarray(params, dtype=np.float64).ravel()
    packed = np.empty(values.size + 1)
    packed[:-1] = values
    packed[-1] = values @ values
    total = np.empty_like(packed)
    comm.Allreduce(packed, total)  # mpi4py's default op is the sum
    n = comm.Get_size()
    mean = total[:-1] / n
    deviation = float(np.linalg.norm(values - mean))
    norm = float(np.linalg.norm(mean))
    return {
        "deviation": deviation,
        "relative_deviation": deviation / norm if norm > 0 else deviation,
        "distance": float(np.sqrt(max(total[-1] / n - mean @ mean, 0.0))),
        "mean_norm": norm,
    }


# The names SGP's figures go by in every logger (Keras logs, TensorBoard, Lightning): name ->
# key in engine.metrics() (local, free) or in engine.consensus() (one allreduce).
LOCAL_SCALARS = {"sgp_weight": "weight", "sgp_wait_seconds": "total_wait_seconds",
                 "sgp_bytes_sent": "bytes_sent"}
CONSENSUS_SCALARS = {"sgp_deviation": "deviation", "sgp_elastic": "elastic",
                     "sgp_distance": "distance"}
NETWORK_SCALARS = ("sgp_distance",)  # equal on every rank: one value, not one per rank


def scalars(figures: dict, consensus_figures: Optional[dict] = None) -> dict:
    """This rank's figures under the loggers' names (consensus ones when given)."""
    named = {name: float(figures[key]) for name, key in LOCAL_SCALARS.items()}
    if consensus_figures is not None:
        named.update({name: float(consensus_figures[key])
                      for name, key in CONSENSUS_SCALARS.items()})
    return named


def by_rank(rows: Sequence[dict]) -> dict:
    """Every rank's scalars (``rows[r]`` from rank r) as one dict for a logger on one rank:
    ``name/rank<r>`` per rank, the network-wide ones once under their own name."""
    named = {}
    for rank, row in enumerate(rows):
        for name, value in row.items():
            if name in NETWORK_SCALARS:
                named[name] = value
            else:
                named[f"{name}/rank{rank}"] = value
    return named


class ElasticConsistency:
    """The elastic-consistency estimate of a run: the largest deviation seen divided by the
    learning rate (how far a node's view may drift from the network average, per unit step).

    Elastic consistency (Nadiradze et al., arXiv 2001.05918) asks that the view v_i at which
    node i takes its gradient stay within lr * B of the average model; B bounds the cost of
    every communication-reduced variant (compression, local steps, delays) in one constant.
    Here v_i is the de-biased z_i, so B is estimated as max ||z_i - mean|| / lr."""

    def __init__(self) -> None:
        self.bound = 0.0

    def update(self, deviation: float, lr: float) -> float:
        if lr > 0:
            self.bound = max(self.bound, deviation / lr)
        return self.bound


class MetricsLog:
    """Every ``every`` steps: consensus measures of every rank, appended by rank 0 to a JSON
    lines file (``python -m hvd_sgp.plot`` draws them). ``elastic_constant`` is the run's
    elastic-consistency constant so far: the largest estimate over ranks and steps."""

    def __init__(self, path: str, every: int, comm: MPI.Comm, label: str):
        self.path, self.every, self.comm, self.label = path, every, comm, label
        self.elastic = ElasticConsistency()

    def record(self, step: int, params: np.ndarray, weight: float, lr: float) -> Optional[dict]:
        if step % self.every:
            return None
        c = consensus(params, self.comm)
        c["elastic"] = self.elastic.update(c["deviation"], lr)
        c["weight"] = weight
        rows = self.comm.gather(c, root=0)
        if self.comm.Get_rank() == 0:
            entry = {"step": step, "label": self.label, "distance": c["distance"], "lr": lr,
                     **{k: [r[k] for r in rows] for k in ("deviation", "relative_deviation",
                                                        "weight", "elastic")}}
            entry["elastic_constant"] = max(entry["elastic"])
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return c


def run_label(options: "SgpOptions", codec_spec: str = "none", feeds_back: bool = False) -> str:
    """A short label for logs and plots, e.g. 'sgp exponential peers=1' or
    'sgp exponential peers=1 overlap tau=2 topk:0.01 no-ef' (``feeds_back``: whether
    error feedback changes how the codec gossips, mixers.feeds_back)."""
    topology = options.topology if isinstance(options.topology, str) else repr(options.topology)
    label = options.schedule or f"{options.mode} {topology} peers={options.peers}"
    label += f" overlap tau={options.max_delay}" if options.overlap else ""
    if codec_spec != "none":
        label += f" {codec_spec}" + ("" if options.error_feedback or not feeds_back
                                     else " no-ef")
    label += f" H={options.local_steps}" if options.local_steps > 1 else ""
    label += f" outer={options.outer_optimizer}" if options.outer_optimizer is not None else ""
    label += f" fragments={options.outer_fragments}" if options.outer_fragments > 1 else ""
    return label + (f" slowmo={options.slowmo:g}" if options.slowmo is not None else "")


class Timeline:
    """Chrome trace events of one rank, written as they happen to ``<path>.rank<r>``.

    At exit every rank closes its file and rank 0 merges them into ``path`` (waiting a few
    seconds for the others; on several hosts without a shared file system, copy the parts
    together and run ``python -m hvd_sgp.common.telemetry PATH``)."""

    def __init__(self, path: str, rank: int, size: int, mark_cycles: Optional[bool] = None):
        self.path, self.rank, self.size = path, rank, size
        self.mark_cycles = marks_cycles() if mark_cycles is None else mark_cycles
        self._file = open(f"{path}.rank{rank}", "w")
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._compute_from: Optional[float] = None

    @staticmethod
    def now_us() -> float:
        return time.time() * 1e6  # wall clock: the ranks' rows line up

    def event(self, name: str, start_us: float, end_us: float, **args) -> None:
        record = {"name": name, "ph": "X", "pid": self.rank, "tid": 0, "ts": start_us,
                  "dur": max(end_us - start_us, 0.0), "args": args}
        with self._lock:
            self._file.write(json.dumps(record) + ",\n")

    def ended_now(self, name: str, seconds: float, **args) -> None:
        """An event that lasted ``seconds`` and just ended (waits measured elsewhere)."""
        now = self.now_us()
        self.event(name, now - seconds * 1e6, now, **args)

    @contextmanager
    def span(self, name: str, **args) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            self.event(name, start, self.now_us(), **args)

    def step_boundary(self, step: int) -> None:
        """Close the compute span that ran since the previous exchange."""
        now = self.now_us()
        if self._compute_from is not None:
            self.event("compute", self._compute_from, now, step=step)
        self._compute_from = now
        if self.mark_cycles:  # horovodrun --timeline-mark-cycles: one mark per gossip step
            record = {"name": "CYCLE_START", "ph": "i", "s": "p", "pid": self.rank, "tid": 0,
                      "ts": now, "args": {"step": step}}
            with self._lock:
                self._file.write(json.dumps(record) + ",\n")

    def resume_compute(self) -> None:
        self._compute_from = self.now_us()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps({"name": "process_name", "ph": "M",
                                             "pid": self.rank,
                                             "args": {"name": f"rank {self.rank}"}}) + "\n]\n")
                self._file.close()

    def finish(self, patience: float = 10.0) -> None:
        """Close; on rank 0, wait for the other ranks' files to close, then merge."""
        self.close()
        if self.rank != 0:
            return
        deadline = time.monotonic() + patience
        parts = [f"{self.path}.rank{r}" for r in range(self.size)]
        while time.monotonic() < deadline and not all(_closed(p) for p in parts):
            time.sleep(0.1)
        merge_timeline(self.path)


def _closed(part: str) -> bool:
    try:
        with open(part, "rb") as f:
            f.seek(max(os.path.getsize(part) - 3, 0))
            return f.read().strip().endswith(b"]")
    except OSError:
        return False


def merge_timeline(path: str) -> int:
    """Merge the per-rank files ``<path>.rank*`` into one Chrome trace; returns events merged."""
    events = []
    for part in sorted(glob.glob(f"{glob.escape(path)}.rank*")):
        with open(part) as f:
            text = f.read().rstrip().rstrip(",")
        if not text.endswith("]"):
            text += "]"  # a rank that did not close: keep what it wrote
        events.extend(json.loads(text))
        os.remove(part)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


def open_timeline(rank: int, size: int) -> Optional[Timeline]:
    """This rank's timeline where one was asked for (``timeline_path``), finished at exit."""
    path = timeline_path()
    if not path:
        return None
    timeline = Timeline(path, rank, size)
    atexit.register(timeline.finish)
    return timeline


def timeline_path() -> Optional[str]:
    """The file named by HVD_SGP_TIMELINE or HOROVOD_TIMELINE; Horovod's "DYNAMIC" means none
    until hvd.start_timeline()."""
    path = os.environ.get("HVD_SGP_TIMELINE") or os.environ.get("HOROVOD_TIMELINE") or None
    return None if path == "DYNAMIC" else path


def marks_cycles() -> bool:
    """Whether HOROVOD_TIMELINE_MARK_CYCLES (``sgprun --timeline-mark-cycles``) asks for a mark
    at every gossip step."""
    return os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").strip().lower() in (
        "1", "true", "yes", "on")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m hvd_sgp.common.telemetry TIMELINE.json  (merges TIMELINE.json.rank*)")
    print(f"merged {merge_timeline(sys.argv[1])} events into {sys.argv[1]}")
