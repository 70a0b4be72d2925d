"""Run a check script under the embedded mpirun; many checks per launch keep the suite fast."""
from __future__ import annotations

import importlib.util
import os
import signal
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def mpirun_path() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def run_mpi(n: int, script: str, *args: str, env: dict | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
    """Launch ``script`` (a file in tests/) on n ranks; by default every rank is its own node."""
    environ = dict(os.environ)
    environ.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "OMPI_MCA_rmaps_base_oversubscribe": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                    "OMPI_MCA_mpi_yield_when_idle": "1", "HVD_SGP_LOCAL_SIZE": "1",
                    # no libfabric here: probing for it costs every rank 1.0 s in MPI_Init
                    "OMPI_MCA_btl": "^ofi",
                    "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO), environ.get("PYTHONPATH", "")])})
    environ.update(env or {})
    command = [mpirun_path(), "-np", str(n), "--bind-to", "none", sys.executable,
               str((HERE / script).resolve()), *args]
    proc = subprocess.run(command, env=environ, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} on {n} ranks exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


# Check scripts that share launches: a rank's start-up (Python, torch, torch's first optimizer
# importing torch._dynamo) costs about 2.5 s of CPU, paid once per launch, and TensorFlow's
# import 2.7 s more. The scripts declared (at import, so before any test runs) for the same world
# size and environment (layout, Keras) run one after another in one launch; the first test to ask
# runs it, so pytest's durations charge it all to that test.
Key = tuple[int, tuple[tuple[str, str], ...]]  # (ranks, the launch's environment)
_SHARING: dict[Key, list[str]] = {}  # -> members
_SHARED: dict[Key, tuple[dict[str, list[str]], str, str]] = {}
MARK = "=== world_checks "


class SharedChecks:
    """``script args`` (a check script of tests/), launched with the others declared for the
    same world size, layout and ``env`` on each of ``worlds``, and alone on other world sizes.
    A script that ``needs`` a package not installed shares no launch (its test skips)."""

    def __init__(self, script: str, *args: str, worlds: Iterable[int] = (),
                 local_size: str = "1", env: dict | None = None, needs: str | None = None):
        self.script, self.args = script, args
        self.env = {"HVD_SGP_LOCAL_SIZE": local_size, **(env or {})}
        self.member = shlex.join((script, *args))
        self.worlds = set(worlds) if needs is None or importlib.util.find_spec(needs) else set()
        for n in self.worlds:
            _SHARING.setdefault(self._key(n), []).append(self.member)

    def _key(self, n: int) -> Key:
        return n, tuple(sorted(self.env.items()))

    def run(self, n: int, timeout: float = 900) -> str:
        """Rank 0's output of the script on n ranks. From the shared launch where it finished
        there; else from a launch of its own (where that launch ended before the script did,
        or the script failed there: then it must fail alone too, else the error names the
        scripts run before it)."""
        if n not in self.worlds:
            return run_mpi(n, self.script, *self.args, env=self.env, timeout=timeout).stdout
        key = self._key(n)
        members = _SHARING[key]
        if key not in _SHARED:
            _SHARED[key] = _launch_together(n, members, self.env, timeout * len(members))
        sections, stdout, stderr = _SHARED[key]
        lines = sections.get(self.member, [])
        if lines and lines[-1] == f"{MARK}end {self.member}":
            return "\n".join(lines)
        alone = run_mpi(n, self.script, *self.args, env=self.env, timeout=timeout).stdout
        if lines:
            before = members[:members.index(self.member)]
            raise AssertionError(f"{self.member} passed alone on {n} ranks but failed in one "
                                 f"launch after {before}\n--- stdout ---\n{stdout}\n"
                                 f"--- stderr ---\n{stderr}")
        return alone


def _launch_together(n: int, members: list[str], env: dict,
                     timeout: float) -> tuple[dict[str, list[str]], str, str]:
    """One launch of world_checks.py running ``members``; rank 0's lines of each, by member."""
    try:
        proc = run_mpi(n, "world_checks.py", *members, env=env, timeout=timeout, check=False)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:
        stdout, stderr = _text(expired.stdout), f"timed out after {expired.timeout} s"
    sections: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith(MARK):
            word, member = line[len(MARK):].split(" ", 1)
            current = member if word == "begin" else None
            sections.setdefault(member, []).append(line)
        elif current is not None:
            sections[current].append(line)
    return sections, stdout[-6000:], stderr[-6000:]


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_checked(*command, **kwargs) -> str:
    """Run a plain command (not under MPI); its stdout, or an assertion with its output."""
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=600, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def run_bounded(cmd: list, timeout: float, what: str, **popen) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a launcher: sgprun, salloc) to its end; past ``timeout`` kill it and
    every process below it (no orphans hold the machine) and fail naming ``what``."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = proc.communicate()
            raise AssertionError(f"{what} timed out after {timeout} s\n{out[-4000:]}\n"
                                 f"{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), children first found first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found
