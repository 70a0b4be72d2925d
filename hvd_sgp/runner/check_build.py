"""``sgprun --check-build``: what this installation can use, like ``horovodrun --check-build``.

Each probe (MPI, PyTorch, TensorFlow) runs in its own Python subprocess, all at once: MPI must
not start inside the launcher, the frameworks are slow to import and are not always happy to
share a process, and a probe that crashes must not take the report with it.
Run as ``python -m hvd_sgp.runner.check_build --probe NAME`` a probe prints one JSON line.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from typing import Callable, Optional

from hvd_sgp.runner.launch import LaunchError, embedded_mpirun, launcher_flavour
from hvd_sgp.version import __version__

PROBE_TIMEOUT_S = 120


def _probe_mpi() -> dict:
    from hvd_sgp.common import runtime

    runtime.init()
    return {
        "library": runtime.mpi_library(),
        "thread_multiple": runtime.mpi_threads_supported(),
        "cuda_aware": runtime.cuda_aware_mpi(),
    }


def _probe_torch() -> dict:
    import torch
    import torch.distributed as dist

    nccl = torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
    return {
        "version": torch.__version__,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if nccl else None,
    }


def _probe_tensorflow() -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    return {"version": tf.__version__, "gpus": len(tf.config.list_physical_devices("GPU"))}


PROBES: dict[str, tuple[str, Callable[[], dict]]] = {
    # name: (module that must be installed, probe)
    "mpi": ("mpi4py", _probe_mpi),
    "torch": ("torch", _probe_torch),
    "tensorflow": ("tensorflow", _probe_tensorflow),
}


def run_probe(name: str) -> dict:
    """Run one probe in this process: its facts, or ``{"missing": True}`` if not installed."""
    module, probe = PROBES[name]
    if importlib.util.find_spec(module) is None:
        return {"missing": True}
    return probe()


def gather() -> dict[str, dict]:
    """Every probe's facts, each from its own subprocess; a failed one gives ``{"error": ...}``."""
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "hvd_sgp.runner.check_build", "--probe", name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in PROBES
    }
    facts = {}
    for name, process in running.items():
        try:
            out, err = process.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            facts[name] = {"error": f"no answer within {PROBE_TIMEOUT_S} s"}
            continue
        lines = out.strip().splitlines()
        try:
            facts[name] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            last = (err.strip().splitlines() or [f"exit status {process.returncode}"])[-1]
            facts[name] = {"error": last}
    return facts


def _mark(flag: bool) -> str:
    return "[X]" if flag else "[ ]"


def _framework(label: str, facts: dict) -> str:
    if facts.get("missing"):
        return f"    [ ] {label} (not installed)"
    if "error" in facts:
        return f"    [ ] {label} (import failed: {facts['error']})"
    return f"    [X] {label} {facts['version']}"


def _launcher_line() -> str:
    launcher = embedded_mpirun()
    if launcher is None:
        return "none beside this Python (pass --mpi-launcher)"
    try:
        flavour, major = launcher_flavour(launcher, os.environ)
    except LaunchError as exc:
        return f"{launcher} ({exc})"
    name = {"openmpi": "Open MPI", "mpich": "MPICH/hydra"}[flavour]
    return f"{launcher} ({name}{f' {major}' if major else ''})"


def _horovod_line() -> str:
    try:
        return f"    [X] Horovod {importlib.metadata.version('horovod')}"
    except importlib.metadata.PackageNotFoundError:
        return "    [ ] Horovod (not installed)"


def report() -> str:
    """The human-readable report that ``sgprun --check-build`` prints."""
    facts = gather()
    mpi, torch, tf = facts["mpi"], facts["torch"], facts["tensorflow"]
    lines = [f"hvd_sgp {__version__}", "", "MPI:"]
    if mpi.get("missing") or "error" in mpi:
        why = "mpi4py not installed" if mpi.get("missing") else mpi["error"]
        lines.append(f"    [ ] MPI ({why})")
    else:
        lines += [
            f"    [X] MPI: {mpi['library']}",
            f"    {_mark(mpi['thread_multiple'])} MPI_THREAD_MULTIPLE (overlapped gossip)",
            f"    {_mark(mpi['cuda_aware'])} CUDA-aware MPI",
        ]
    lines += [f"    launcher: {_launcher_line()}", "", "Frameworks:",
              _framework("PyTorch", torch), _framework("TensorFlow", tf), _horovod_line(),
              "", "GPU:"]
    gpus = torch.get("gpus", 0) if "version" in torch else 0
    lines += [
        f"    {_mark(gpus > 0)} CUDA ({gpus} GPU{'s' if gpus != 1 else ''} visible to PyTorch)",
        f"    {_mark(bool(torch.get('nccl')))} NCCL"
        + (f" {torch['nccl']}" if torch.get("nccl") else ""),
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``--probe NAME`` prints one probe's JSON; without it, the whole report."""
    parser = argparse.ArgumentParser(prog="python -m hvd_sgp.runner.check_build")
    parser.add_argument("--probe", choices=sorted(PROBES))
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(run_probe(args.probe)), flush=True)
    else:
        print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
