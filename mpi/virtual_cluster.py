#!/usr/bin/env python3
"""A virtual cluster on one machine: N hosts as network namespaces with shaped links.

Why: SGP's advantage over AllReduce appears when links are slow, and a laptop's loopback is
not. Each emulated host is a network namespace with one veth into a private "switch"
namespace holding a bridge; every link is shaped in both directions with ``tbf`` (egress on the
host's veth, egress on its bridge port), so every byte between two ranks crosses two shaped
links. Open MPI launches ranks inside the namespaces through PRRTE's ssh launcher pointed at a
local agent script (``ip netns exec <ns> unshare --uts``, one hostname per host), and ``mpirun``
itself runs in host 0. Needs root, ``ip`` and ``tc``; uses only the subnet it creates.

    sudo python mpi/virtual_cluster.py up --hosts 8 --rate 1gbit        # Ctrl-C tears down
    sudo python mpi/virtual_cluster.py up --hosts 8 --detach             # stays up
    sudo python mpi/virtual_cluster.py check                             # reach + throughput
    sudo python mpi/virtual_cluster.py run -np 8 -- python train.py      # mpirun inside
    sudo python mpi/virtual_cluster.py counters                          # bytes per host
    sudo python mpi/virtual_cluster.py down                              # idempotent
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_ROOT = Path("/run/hvd_sgp_vcluster")
NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/hosts on /etc/hosts
MPI_FLAGS = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--bind-to", "none",
             "--mca", "mpi_yield_when_idle", "1", "--prtemca", "plm_ssh_no_tree_spawn", "1",
             "--prtemca", "rmaps_default_mapping_policy", ":oversubscribe"]
RING_ALLREDUCE = ["--mca", "coll_tuned_use_dynamic_rules", "1",
                  "--mca", "coll_tuned_allreduce_algorithm", "4"]
AGENT = """#!/bin/sh
# PRRTE's ssh launcher calls: <agent> [ssh options] <host> <command...>
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec ip netns exec "%(prefix)s-$host" unshare --uts /bin/sh -c "hostname $host; $*"
"""


@dataclass
class Cluster:
    """What ``up`` created; saved as JSON so ``run``, ``counters`` and ``down`` find it."""

    prefix: str
    hosts: int
    subnet: str
    rate: str
    delay: str = ""
    jitter: str = ""
    delay_emulated: bool = False

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.prefix

    @property
    def switch(self) -> str:
        return f"{self.prefix}-switch"

    def host(self, i: int) -> str:
        return f"h{i}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-{self.host(i)}"

    def address(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    @property
    def hostfile(self) -> Path:
        return self.state_dir / "hostfile"

    @property
    def agent(self) -> Path:
        return self.state_dir / "agent.sh"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def in_ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, *args, check=check)


def rate_bytes_per_second(rate: str) -> float:
    """tc's rate syntax (1gbit, 100mbit, 10mbps...) as bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8,
             "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "bps": 1}
    low = rate.lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return float(low[: -len(unit)]) * factor
    return float(low) / 8


def shape(ns: str, dev: str, cluster: Cluster) -> bool:
    """Shape egress of ``dev``: netem delay (when the kernel has it) above a tbf rate limit.
    Returns whether the delay is emulated."""
    rate = rate_bytes_per_second(cluster.rate)
    burst = max(int(rate / 1000), 128 * 1024)  # 1 ms of traffic, above a 64 KB GSO segment
    tbf = ["rate", cluster.rate, "burst", str(burst), "latency", "50ms"]
    if cluster.delay:
        netem = ["delay", cluster.delay] + ([cluster.jitter] if cluster.jitter else [])
        added = in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      *netem, check=False)
        if added.returncode == 0:
            in_ns(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf",
                  *tbf)
            return True
    in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf)
    return False


def up(cluster: Cluster) -> Cluster:
    """Create the switch, the hosts, their shaped links, the hostfile and the launch agent."""
    if cluster.state_dir.exists():
        raise SystemExit(f"a cluster named {cluster.prefix} is up; run `down` first")
    if os.geteuid() != 0:
        raise SystemExit("the virtual cluster needs root (network namespaces, tc)")
    if cluster.hosts + 2 > ipaddress.ip_network(cluster.subnet).num_addresses:
        raise SystemExit(f"{cluster.subnet} is too small for {cluster.hosts} hosts")
    cluster.state_dir.mkdir(parents=True)
    try:
        sh("ip", "netns", "add", cluster.switch)
        in_ns(cluster.switch, "ip", "link", "add", "br0", "type", "bridge")
        in_ns(cluster.switch, "ip", "link", "set", "br0", "up")
        prefixlen = ipaddress.ip_network(cluster.subnet).prefixlen
        delays = []
        for i in range(cluster.hosts):
            ns, port = cluster.namespace(i), f"p{i}"
            sh("ip", "netns", "add", ns)
            in_ns(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", port,
                  "netns", cluster.switch)
            in_ns(ns, "ip", "addr", "add", f"{cluster.address(i)}/{prefixlen}", "dev", "eth0")
            in_ns(ns, "ip", "link", "set", "lo", "up")
            in_ns(ns, "ip", "link", "set", "eth0", "up")
            in_ns(cluster.switch, "ip", "link", "set", port, "master", "br0")
            in_ns(cluster.switch, "ip", "link", "set", port, "up")
            delays.append(shape(ns, "eth0", cluster))
            delays.append(shape(cluster.switch, port, cluster))
        cluster.delay_emulated = bool(cluster.delay) and all(delays)
        if cluster.delay and not cluster.delay_emulated:
            print(f"warning: this kernel has no netem qdisc: --delay {cluster.delay} is "
                  f"ignored, links are only rate-limited to {cluster.rate}", file=sys.stderr)
        hosts = "".join(f"{cluster.address(i)} {cluster.host(i)}\n"
                        for i in range(cluster.hosts))
        for i in range(cluster.hosts):
            etc = NETNS_ETC / cluster.namespace(i)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
        cluster.hostfile.write_text("".join(f"{cluster.host(i)} slots=64\n"
                                            for i in range(cluster.hosts)))
        cluster.agent.write_text(AGENT % {"prefix": cluster.prefix})
        cluster.agent.chmod(0o755)
        (cluster.state_dir / "cluster.json").write_text(json.dumps(asdict(cluster)))
    except BaseException:
        down(cluster.prefix)
        raise
    return cluster


def load(prefix: str) -> Cluster:
    path = STATE_ROOT / prefix / "cluster.json"
    if not path.exists():
        raise SystemExit(f"no virtual cluster named {prefix} is up (run `up` first)")
    return Cluster(**json.loads(path.read_text()))


def down(prefix: str) -> list[str]:
    """Delete every namespace, /etc/netns entry and state file of ``prefix``; idempotent.
    Deleting a namespace deletes its veths, qdiscs and the bridge. Returns what was removed."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.startswith(prefix + "-")]
    for ns in names:
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)  # only processes inside our own namespaces
            except ProcessLookupError:
                pass
        sh("ip", "netns", "delete", ns, check=False)
    for etc in NETNS_ETC.glob(f"{prefix}-*"):
        shutil.rmtree(etc, ignore_errors=True)
        names.append(str(etc))
    if (STATE_ROOT / prefix).exists():
        shutil.rmtree(STATE_ROOT / prefix, ignore_errors=True)
        names.append(str(STATE_ROOT / prefix))
    for parent in (NETNS_ETC, STATE_ROOT):  # only when empty: never another tool's entries
        if parent.exists() and not any(parent.iterdir()):
            parent.rmdir()
    return names


def leftovers(prefix: str) -> list[str]:
    """Namespaces, /etc/netns entries and state of ``prefix`` that still exist."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    found = [line.split()[0] for line in listed if line.startswith(prefix + "-")]
    found += [str(p) for p in NETNS_ETC.glob(f"{prefix}-*")]
    return found + ([str(STATE_ROOT / prefix)] if (STATE_ROOT / prefix).exists() else [])


def mpirun_command(cluster: Cluster, np: int, mpirun: str = "mpirun",
                   ring: bool = False) -> list[str]:
    """``mpirun`` with every flag the namespaces need; run it through ``launch_prefix``."""
    return [mpirun, "-np", str(np), "--hostfile", str(cluster.hostfile), "--map-by", "node",
            "--prtemca", "plm_ssh_agent", str(cluster.agent),
            "--prtemca", "prte_if_include", cluster.subnet,
            "--mca", "btl_tcp_if_include", cluster.subnet, *MPI_FLAGS,
            *(RING_ALLREDUCE if ring else [])]


def launch_prefix(cluster: Cluster) -> list[str]:
    """mpirun runs in host 0 (its own hostname), so daemons reach it over the shaped subnet."""
    return ["ip", "netns", "exec", cluster.namespace(0), "unshare", "--uts", "/bin/sh", "-c",
            f'hostname {cluster.host(0)}; exec "$@"', "launcher"]


def run_env(python_bin: Path | None = None) -> dict:
    """Environment for mpirun: root allowed, the Python environment's bin first on PATH (the
    agent finds ``prted`` there), every rank its own SGP node."""
    env = dict(os.environ)
    bin_dir = str(python_bin or Path(sys.executable).parent)
    env.update({"PATH": os.pathsep.join([bin_dir, env.get("PATH", "")]),
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "HVD_SGP_LOCAL_SIZE": "1", "OMP_NUM_THREADS": "1"})
    return env


def counters(cluster: Cluster) -> list[dict]:
    """Bytes and packets each host sent and received on its shaped link (``ip -s link``)."""
    result = []
    for i in range(cluster.hosts):
        out = in_ns(cluster.namespace(i), "ip", "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        result.append({"host": cluster.host(i), "tx_bytes": stats["tx"]["bytes"],
                       "rx_bytes": stats["rx"]["bytes"], "tx_packets": stats["tx"]["packets"],
                       "tx_dropped": stats["tx"]["dropped"]})
    return result


def check(cluster: Cluster, megabytes: float = 25.0) -> dict:
    """Reach h1 from h0 over TCP and time ``megabytes`` through the shaped links."""
    port = 47077
    server = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
              f"socket.SO_REUSEADDR,1);s.bind(('{cluster.address(1)}',{port}));s.listen(1);"
              "c,_=s.accept();n=0\nwhile True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
              "c.sendall(b'k');print(n)")
    client = (f"import socket,time;s=socket.create_connection(('{cluster.address(1)}',{port}),"
              "timeout=10);d=b'x'*(1<<20);t=time.perf_counter()\n"
              f"for _ in range({int(megabytes)}): s.sendall(d)\n"
              "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)")
    srv = subprocess.Popen(["ip", "netns", "exec", cluster.namespace(1), sys.executable, "-c",
                            server], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(50):  # the server needs a moment to listen
            out = in_ns(cluster.namespace(0), sys.executable, "-c", client, check=False)
            if out.returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"{cluster.host(0)} cannot reach {cluster.host(1)}: {out.stderr}")
        received = int(srv.communicate(timeout=30)[0])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    seconds = float(out.stdout)
    return {"bytes": received, "seconds": seconds,
            "gbit_per_s": received * 8 / seconds / 1e9,
            "link_gbit_per_s": rate_bytes_per_second(cluster.rate) * 8 / 1e9}


def wait_forever(cluster: Cluster) -> None:
    """Hold the cluster until Ctrl-C or SIGTERM, then tear it down."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        down(cluster.prefix)
        print(f"virtual cluster {cluster.prefix} torn down", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default="sgpv", help="namespace name prefix")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create the hosts; hold until Ctrl-C unless --detach")
    p_up.add_argument("--hosts", type=int, default=8)
    p_up.add_argument("--rate", default="1gbit", help="tc rate of every link, each direction")
    p_up.add_argument("--delay", default="", help="one-way delay (needs netem, e.g. 0.5ms)")
    p_up.add_argument("--jitter", default="", help="delay jitter (needs netem)")
    p_up.add_argument("--subnet", default="10.77.0.0/24")
    p_up.add_argument("--detach", action="store_true", help="leave it up and return")
    sub.add_parser("down", help="remove everything (idempotent)")
    sub.add_parser("check", help="TCP reachability and throughput h0 -> h1")
    sub.add_parser("counters", help="bytes sent/received on every host's link")
    p_run = sub.add_parser("run", help="mpirun inside the cluster: run -np N -- command...")
    p_run.add_argument("-np", type=int, required=True)
    p_run.add_argument("--ring", action="store_true", help="Open MPI's ring allreduce")
    p_run.add_argument("--print", action="store_true", help="print the command, do not run")
    p_run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "down":
        for removed in down(args.prefix):
            print(f"removed {removed}")
        return 0
    if args.command == "up":
        cluster = up(Cluster(args.prefix, args.hosts, args.subnet, args.rate, args.delay,
                             args.jitter))
        print(cluster.hostfile.read_text(), end="")
        print(f"# hostfile: {cluster.hostfile}\n# mpirun: "
              f"{shlex.join(launch_prefix(cluster) + mpirun_command(cluster, cluster.hosts))}",
              flush=True)
        if not args.detach:
            wait_forever(cluster)
        return 0
    cluster = load(args.prefix)
    if args.command == "check":
        print(json.dumps(check(cluster)))
    elif args.command == "counters":
        print(json.dumps(counters(cluster), indent=1))
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        full = launch_prefix(cluster) + mpirun_command(cluster, args.np, ring=args.ring) + cmd
        if args.print:
            print(shlex.join(full))
            return 0
        return subprocess.run(full, env=run_env(), check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
