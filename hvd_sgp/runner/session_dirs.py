"""What a killed ``mpirun`` leaves behind, and why sgprun removes it.

Open MPI 5's mpirun (PRRTE's prterun) keeps its PMIx rendezvous files in
``<tmpdir>/ompi.<its pid>`` and removes the directory when it exits. Killed by SIGKILL (a
frozen head sgprun ends, a scheduler's time limit, the OOM killer) it cannot, and the directory
stays. Pids come round again (``pid_max`` is 32768 on many machines, and a training job's threads
use them fast): the prterun that gets the same pid finds the files, and stops with "The PMIx
server's listener thread failed to start" before any rank has started. That stopped a CI run of
this project. So sgprun removes the directory of a head it killed, and before each Open MPI
launch reclaims the directories whose prterun is gone, on this machine and for this user only.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Mapping

NAME = re.compile(r"ompi\.(\d+)")
HEADS = ("prterun", "mpirun", "mpiexec", "orterun")  # what /proc/<pid>/comm reads for a head


def base(env: Mapping[str, str]) -> Path:
    """Where prterun makes its directory: the MCA choice, else the temporary directory its
    environment names (PRRTE reads them in this order), else /tmp."""
    for name in ("PRTE_MCA_prte_tmpdir_base", "TMPDIR", "TEMP", "TMP"):
        if env.get(name):
            return Path(env[name])
    return Path("/tmp")


def _this_host(host: str) -> bool:
    name = socket.gethostname()
    return host in (name, name.split(".")[0])


def _owned_here(directory: Path, pid: int) -> bool:
    """A prterun session directory of this user on this machine: PMIx's rendezvous file
    ``pmix.<host>.tool.<pid>`` names the machine (a shared TMPDIR holds other machines' ones)."""
    try:
        if directory.stat().st_uid != os.geteuid():
            return False
        names = os.listdir(directory)
    except OSError:
        return False
    suffix = f".tool.{pid}"
    return any(name.startswith("pmix.") and name.endswith(suffix)
               and _this_host(name[len("pmix."):-len(suffix)]) for name in names)


def head_alive(pid: int) -> bool:
    """Whether a prterun still runs as ``pid``: no process there, or one that is not a head
    (the pid came round to another program), means the directory is left over."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return True  # no /proc: a live pid is taken to be the head
    return comm in HEADS


def remove(pid: int, env: Mapping[str, str]) -> bool:
    """Remove the directory of the head ``pid`` that sgprun killed; whether there was one."""
    directory = base(env) / f"ompi.{pid}"
    if not _owned_here(directory, pid) or head_alive(pid):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def reclaim(env: Mapping[str, str]) -> list[Path]:
    """Remove every session directory of this user and machine whose prterun is gone; the
    directories removed."""
    root = base(env)
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    matches = (NAME.fullmatch(name) for name in entries)
    return [root / match.group(0) for match in matches
            if match and remove(int(match.group(1)), env)]
