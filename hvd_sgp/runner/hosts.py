"""Hosts of a launch: ``-H host1:slots,...`` and hostfiles, as horovodrun reads them."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """One entry of ``-H`` or a hostfile: a host name and how many processes it takes."""

    name: str
    slots: int


def _host_entry(entry: str, where: str) -> Host:
    name, sep, slots = entry.partition(":")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"malformed host entry {entry!r} in {where}: expected host or host:slots")
    if not sep:
        return Host(name, 1)
    if not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"malformed host entry {entry!r} in {where}: slots must be a positive "
                         "integer")
    return Host(name, int(slots))


def parse_hosts(spec: str) -> list[Host]:
    """Parse ``-H host1:slots,host2:slots`` (slots default to 1, as in horovodrun)."""
    entries = [entry.strip() for entry in spec.split(",")]
    if not spec.strip() or not all(entries):
        raise ValueError(f"malformed host list {spec!r}: expected host1:slots,host2:slots,...")
    return [_host_entry(entry, "-H") for entry in entries]


def read_hostfile(path: str) -> list[Host]:
    """Read a hostfile in Open MPI's (``host slots=4``) or MPICH's (``host:4``) syntax.

    Both syntaxes are accepted so one file serves either MPI; sgprun passes the hosts on the
    command line in the launcher's own syntax.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        raise ValueError(f"hostfile {path!r} not found") from None
    except OSError as exc:
        raise ValueError(f"cannot read hostfile {path!r}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path} line {number}"
        words = line.split()
        if len(words) == 1:
            hosts.append(_host_entry(words[0], where))
            continue
        match = re.fullmatch(r"slots=(\d+)", words[1])
        if len(words) != 2 or ":" in words[0] or not match or int(match.group(1)) < 1:
            raise ValueError(f"malformed line {raw.strip()!r} in {where}: expected "
                             "'host slots=N' or 'host:N'")
        hosts.append(Host(words[0], int(match.group(1))))
    if not hosts:
        raise ValueError(f"hostfile {path!r} names no hosts")
    return hosts
