"""horovodrun's flags (Horovod 0.28.1), declared once, with what each becomes under sgprun.

A Horovod launch command must keep working with ``horovodrun`` replaced by ``sgprun``. Every
horovodrun flag is one ``HorovodFlag`` in ``FLAGS``: its spellings, its value, its key in a
horovodrun ``--config-file``, the variable it sets on the ranks, and how sgprun honours it:

* ``same``: the launch does what horovodrun's does (``note`` says through what);
* ``differs``: honoured in SGP's terms (``note`` says how);
* ``ignored``: no meaning under SGP; accepted, and named in ONE warning line;
* ``refused``: cannot be honoured; sgprun exits 2 with ``note`` as the reason.

sgprun's arguments, the ranks' variables, the config-file reading, the warning line and the
flag rows of docs/horovod_compatibility.md are all generated from this table. The elastic flags
(``--min-np``, ``--max-np``, ``--host-discovery-script``, ...) belong to the fault-tolerance
launcher and are declared there.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from hvd_sgp.common.options import BY_NAME as SGP_OPTIONS
from hvd_sgp.runner.hosts import parse_hosts, read_hostfile

SAME, DIFFERS, IGNORED, REFUSED = "same", "differs", "ignored", "refused"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
CONTROLLERS = ("mpi", "gloo")
DEFAULT_STALL_WARNING_SECONDS = 60  # Horovod's default, also the collectives'
VERSION = "version"  # kind of -v/--version
INTERFACES = "interfaces"  # kind of --network-interface(s): repeatable, comma-separated


def count(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum`` from its text."""

    def parse(text: str) -> int:
        if not str(text).strip().isdigit() or int(text) < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    return parse


def number(low: float, high: float = math.inf) -> Callable[[str], float]:
    """A number in [low, high] from its text."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            bound = f"in [{low:g}, {high:g}]" if high < math.inf else f">= {low:g}"
            raise ValueError(f"expected a number {bound}, got {text!r}")
        return value

    return parse


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = number(0.0)(text)
    if not 0 < value < math.inf:
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


Kind = Union[type, str, Callable[[str], Any]]


@dataclass(frozen=True)
class HorovodFlag:
    """One horovodrun flag. ``kind``: ``bool`` (a switch: ``spellings`` turn it on, ``off``
    turns it off), ``str``, a parser of the text (``count(0)``, ``seconds``, ``parse_hosts``, ...),
    VERSION or INTERFACES. ``env``: the variable it sets on every rank (a switch as 1/0, or 0/1
    when ``negated``). ``config``: ``section.key`` in horovodrun's YAML config file."""

    dest: str
    spellings: tuple[str, ...]
    status: str
    note: str
    kind: Kind = str
    off: tuple[str, ...] = ()
    env: Optional[str] = None
    negated: bool = False
    config: Optional[str] = None
    group: Optional[str] = None  # flags of one group exclude each other, as in horovodrun

    @property
    def name(self) -> str:
        """How the docs and the warning name it: its long spellings."""
        return "/".join(s for s in self.spellings + self.off if s.startswith("--"))


FLAGS: tuple[HorovodFlag, ...] = (
    # The launch.
    HorovodFlag("version", ("-v", "--version"), DIFFERS, "prints hvd_sgp's version", VERSION),
    HorovodFlag("np", ("-np", "--num-proc"), SAME, "mpirun -np (hydra -n, srun --ntasks)",
                count(1)),
    HorovodFlag("hosts", ("-H", "--hosts"), SAME, "mpirun -H (hydra -hosts, srun --nodelist); "
                "names are resolved and slots counted before anything starts", parse_hosts,
                group="hosts"),
    HorovodFlag("hostfile", ("-hostfile", "--hostfile"), SAME, "read by sgprun ('host slots=N'; "
                "also MPICH's 'host:N') and passed on as a host list", read_hostfile,
                group="hosts"),
    HorovodFlag("ssh_port", ("-p", "--ssh-port"), SAME, "Open MPI --mca plm_ssh_args '-p N' "
                "(refused with hydra and srun: set it in ~/.ssh/config)", count(1)),
    HorovodFlag("ssh_identity_file", ("-i", "--ssh-identity-file"), SAME, "Open MPI --mca "
                "plm_ssh_args '-i FILE' (refused with hydra and srun: set it in ~/.ssh/config)"),
    HorovodFlag("nic", ("--network-interfaces", "--network-interface"), SAME, "Open MPI --mca "
                "btl_tcp_if_include, hydra -iface, and NCCL_SOCKET_IFNAME; repeatable, "
                "comma-separated", INTERFACES),
    HorovodFlag("tcp", ("--tcp",), SAME, "NCCL_IB_DISABLE=1; Open MPI --mca pml ob1 --mca btl "
                "self,sm,tcp", bool, env="NCCL_IB_DISABLE"),
    HorovodFlag("binding_args", ("--binding-args",), SAME, "replaces sgprun's '--bind-to none "
                "--map-by slot' (mpirun and hydra; refused with srun)"),
    HorovodFlag("mpi_args", ("--mpi-args",), SAME, "appended to the launcher's arguments"),
    HorovodFlag("output_filename", ("--output-filename",), SAME, "mpirun --output-filename "
                "(hydra -outfile-pattern/-errfile-pattern, srun --output/--error per rank)"),
    HorovodFlag("prefix_output_with_timestamp", ("-prefix-timestamp",
                "--prefix-output-with-timestamp"), SAME, "Open MPI --timestamp-output "
                "(--output timestamp in 5.x); refused with hydra and srun", bool,
                group="timestamp"),
    HorovodFlag("verbose", ("--verbose",), SAME, "prints the launch command first", bool),
    HorovodFlag("check_build", ("-cb", "--check-build"), DIFFERS, "reports hvd_sgp's MPI "
                "(threading, CUDA-aware), frameworks and GPU features", bool),
    HorovodFlag("disable_cache", ("--disable-cache",), SAME, "sgprun keeps no cache: its checks "
                "run at every launch", bool),
    HorovodFlag("config_file", ("--config-file",), SAME, "horovodrun's YAML sections and keys "
                "(needs PyYAML); flags given on the command line win"),
    HorovodFlag("mpi", ("--mpi",), SAME, "nothing to do: hvd_sgp always runs over MPI", bool,
                group="controller"),
    HorovodFlag("gloo", ("--gloo",), REFUSED, "hvd_sgp runs over MPI only: drop --gloo (or use "
                "--mpi)", bool, group="controller"),
    HorovodFlag("jsrun", ("--jsrun",), REFUSED, "sgprun launches with mpirun or srun: drop "
                "--jsrun and use --launcher/--mpi-launcher", bool, group="controller"),
    # Timeline and stall check.
    HorovodFlag("timeline_filename", ("--timeline-filename",), DIFFERS, "HVD_SGP_TIMELINE: one "
                "row per rank with compute, gossip send/receive and wait spans (not Horovod's "
                "per-tensor negotiation states)", env="HVD_SGP_TIMELINE", config="timeline.filename"),
    HorovodFlag("timeline_mark_cycles", ("--timeline-mark-cycles",), DIFFERS,
                "HOROVOD_TIMELINE_MARK_CYCLES: a CYCLE_START mark at every gossip step", bool,
                off=("--no-timeline-mark-cycles",), env="HOROVOD_TIMELINE_MARK_CYCLES",
                config="timeline.mark_cycles"),
    HorovodFlag("stall_check", ("--stall-check",), SAME, "HOROVOD_STALL_CHECK_DISABLE: the "
                "collectives' warning about ranks that have not submitted", bool,
                off=("--no-stall-check",), env="HOROVOD_STALL_CHECK_DISABLE", negated=True,
                config="stall_check.enabled"),
    HorovodFlag("stall_check_warning_time_seconds", ("--stall-check-warning-time-seconds",),
                SAME, "HOROVOD_STALL_CHECK_TIME_SECONDS", count(1),
                env="HOROVOD_STALL_CHECK_TIME_SECONDS",
                config="stall_check.warning_time_seconds"),
    HorovodFlag("stall_check_shutdown_time_seconds", ("--stall-check-shutdown-time-seconds",),
                DIFFERS, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; when longer than the warning time "
                "it is also every wait's deadline (HVD_SGP_TIMEOUT) unless --timeout or "
                "HVD_SGP_TIMEOUT is given", count(0), env="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                config="stall_check.shutdown_time_seconds"),
    # No meaning under SGP: accepted, named in one warning line.
    HorovodFlag("start_timeout", ("--start-timeout",), IGNORED, "no start phase to time out: "
                "every wait on a peer has the --timeout deadline", seconds),
    HorovodFlag("fusion_threshold_mb", ("--fusion-threshold-mb",), IGNORED, "SGP sends all "
                "parameters in one fused message per peer: no fusion buffer to size", count(0),
                config="params.fusion_threshold_mb"),
    HorovodFlag("cycle_time_ms", ("--cycle-time-ms",), IGNORED, "no background cycle: each "
                "optimizer step exchanges once", number(0.0), config="params.cycle_time_ms"),
    HorovodFlag("cache_capacity", ("--cache-capacity",), IGNORED, "no response cache: "
                "collectives are negotiated at every call", count(0),
                config="params.cache_capacity"),
    HorovodFlag("hierarchical_allreduce", ("--hierarchical-allreduce",), IGNORED, "always "
                "hierarchical: exact average within a node, gossip between nodes", bool,
                off=("--no-hierarchical-allreduce",), config="params.hierarchical_allreduce"),
    HorovodFlag("hierarchical_allgather", ("--hierarchical-allgather",), IGNORED, "allgather is "
                "one MPI collective", bool, off=("--no-hierarchical-allgather",),
                config="params.hierarchical_allgather"),
    HorovodFlag("torus_allreduce", ("--torus-allreduce",), IGNORED, "no NCCL torus: nodes gossip "
                "over MPI", bool, off=("--no-torus-allreduce",), config="params.torus_allreduce"),
    HorovodFlag("autotune", ("--autotune",), IGNORED, "nothing to tune: no fusion threshold or "
                "cycle time", bool, off=("--no-autotune",), config="autotune.enabled"),
    HorovodFlag("autotune_log_file", ("--autotune-log-file",), IGNORED, "no autotuning",
                config="autotune.log_file"),
    HorovodFlag("autotune_warmup_samples", ("--autotune-warmup-samples",), IGNORED,
                "no autotuning", count(0), config="autotune.warmup_samples"),
    HorovodFlag("autotune_steps_per_sample", ("--autotune-steps-per-sample",), IGNORED,
                "no autotuning", count(0), config="autotune.steps_per_sample"),
    HorovodFlag("autotune_bayes_opt_max_samples", ("--autotune-bayes-opt-max-samples",),
                IGNORED, "no autotuning", count(0), config="autotune.bayes_opt_max_samples"),
    HorovodFlag("autotune_gaussian_process_noise", ("--autotune-gaussian-process-noise",),
                IGNORED, "no autotuning", number(0.0, 1.0),
                config="autotune.gaussian_process_noise"),
    HorovodFlag("mpi_threads_disable", ("--mpi-threads-disable",), IGNORED, "hvd_sgp asks MPI "
                "for MPI_THREAD_MULTIPLE, which its progress thread needs", bool,
                off=("--no-mpi-threads-disable",), config="library_options.mpi_threads_disable"),
    HorovodFlag("num_nccl_streams", ("--num-nccl-streams",), IGNORED, "in-node NCCL averages "
                "run on torch.distributed's stream", count(0),
                config="library_options.num_nccl_streams"),
    HorovodFlag("thread_affinity", ("--thread-affinity",), IGNORED, "no Horovod background "
                "thread to pin", count(0), config="library_options.thread_affinity"),
    HorovodFlag("gloo_timeout_seconds", ("--gloo-timeout-seconds",), IGNORED, "no Gloo: every "
                "wait's deadline is --timeout", count(0),
                config="library_options.gloo_timeout_seconds"),
    HorovodFlag("log_level", ("--log-level",), IGNORED, "no backend log: hvd_sgp prints "
                "warnings and errors only", log_level, config="logging.level"),
    HorovodFlag("log_with_timestamp", ("--log-with-timestamp", "--no-log-hide-timestamp"),
                IGNORED, "no backend log (see --log-level)", bool,
                off=("--log-without-timestamp", "--log-hide-timestamp"), group="timestamp",
                config="logging.with_timestamp"),
)
BY_DEST = {flag.dest: flag for flag in FLAGS}


class _Given(argparse.Action):
    """Store a flag's value and remember the spelling used, for the warning line."""

    def __call__(self, parser, namespace, values, option_string=None):
        flag = BY_DEST[self.dest]
        if self.nargs == 0:
            value = self.const
        elif flag.kind == INTERFACES:  # repeatable, comma-separated, duplicates dropped
            names = (getattr(namespace, self.dest) or "").split(",") + values.split(",")
            value = ",".join(dict.fromkeys(name.strip() for name in names if name.strip()))
        else:
            value = values
        setattr(namespace, self.dest, value)
        spelled = dict(getattr(namespace, "horovod_spellings", None) or {})
        spelled[self.dest] = option_string
        namespace.horovod_spellings = spelled


def add_arguments(parser: argparse.ArgumentParser,
                  checked: Callable[[Callable[[str], Any]], Callable[[str], Any]]) -> None:
    """Add every flag of ``FLAGS`` to sgprun's parser; ``checked`` turns a text parser's
    ValueError into argparse's message."""
    from hvd_sgp.version import __version__

    group = parser.add_argument_group("horovodrun flags (see docs/horovod_compatibility.md)")
    exclusive: dict[str, Any] = {}
    parser.set_defaults(horovod_spellings=None)
    for flag in FLAGS:
        tag = "" if flag.status in (SAME, DIFFERS) else f"[{flag.status}] "
        help_text = f"{tag}{flag.note}"
        if flag.kind == VERSION:
            parser.add_argument(*flag.spellings, action="version",
                                version=f"hvd_sgp {__version__}", help=help_text)
            continue
        name = flag.group or (flag.dest if flag.off else None)
        if name is not None and name not in exclusive:
            exclusive[name] = group.add_mutually_exclusive_group()
        target = group if name is None else exclusive[name]
        if flag.kind is bool:
            target.add_argument(*flag.spellings, dest=flag.dest, action=_Given, nargs=0,
                                const=True, default=None, help=help_text)
            if flag.off:
                target.add_argument(*flag.off, dest=flag.dest, action=_Given, nargs=0,
                                    const=False, default=None,
                                    help=f"{tag}turns {flag.spellings[0]} off")
            continue
        parse = None if flag.kind in (str, INTERFACES) else checked(flag.kind)
        target.add_argument(*flag.spellings, dest=flag.dest, action=_Given, type=parse,
                            default=None, help=help_text)


def read_config(path: str) -> Mapping[str, Any]:
    """horovodrun's ``--config-file``: a YAML mapping of sections (PyYAML is optional)."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read --config-file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config-file {path!r} is not valid YAML: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"--config-file {path!r} must hold a mapping of sections, "
                         f"not {type(config).__name__}")
    return config


def _config_value(flag: HorovodFlag, value: Any) -> Any:
    if flag.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if flag.kind is str:
        return str(value)
    return flag.kind(str(value))


def apply_config(args: argparse.Namespace, config: Mapping[str, Any], path: str) -> list[str]:
    """Fill the flags the command line left unset from horovodrun's config sections, as
    horovodrun does (the command line wins). Returns the keys sgprun does not know."""
    known = {flag.config: flag for flag in FLAGS if flag.config}
    sections = {name.split(".")[0] for name in known}
    unknown = []
    for section, values in config.items():
        if section == "controller":
            _apply_controller(args, values, path)
            continue
        if section not in sections or not isinstance(values, dict):
            unknown.append(str(section))
            continue
        for key, value in values.items():
            flag = known.get(f"{section}.{key}")
            if flag is None:
                unknown.append(f"{section}.{key}")
            elif getattr(args, flag.dest) is None and value is not None:
                try:
                    setattr(args, flag.dest, _config_value(flag, value))
                except ValueError as exc:
                    raise ValueError(f"--config-file {path!r}: {section}.{key}: {exc}") from None
    return unknown


def _apply_controller(args: argparse.Namespace, value: Any, path: str) -> None:
    choice = str(value).strip().lower()
    if choice not in CONTROLLERS:
        raise ValueError(f"--config-file {path!r}: controller {value!r} is unknown; choose one "
                         f"of {', '.join(CONTROLLERS)}")
    if not (args.mpi or args.gloo or args.jsrun):
        setattr(args, choice, True)


def refusal(args: argparse.Namespace) -> Optional[str]:
    """Why the request cannot run, when it names a refused flag; None otherwise."""
    for flag in FLAGS:
        if flag.status == REFUSED and getattr(args, flag.dest):
            return f"{_spelled(args, flag)}: {flag.note}"
    return None


def _spelled(args: argparse.Namespace, flag: HorovodFlag) -> str:
    """The spelling the command line used, or the config key that set the flag."""
    spelled = (getattr(args, "horovod_spellings", None) or {}).get(flag.dest)
    if spelled:
        return spelled
    return f"{flag.config} (config file)" if flag.config else flag.spellings[-1]


def ignored(args: argparse.Namespace) -> list[str]:
    """The ignored flags this request gives, as it spelled them."""
    return [_spelled(args, flag) for flag in FLAGS
            if flag.status == IGNORED and getattr(args, flag.dest) is not None]


def warning(args: argparse.Namespace, unknown_keys: Sequence[str] = ()) -> Optional[str]:
    """ONE line naming what sgprun accepted but ignores; None when nothing."""
    names = ignored(args) + [f"{key} (unknown config key)" for key in unknown_keys]
    if not names:
        return None
    return ("sgprun: warning: ignored, no meaning under SGP: " + ", ".join(names) +
            " (see docs/horovod_compatibility.md)")


def environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the given flags set on every rank (``env`` of ``FLAGS``), and the deadline
    the stall shutdown time implies when no other is given."""
    out = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.env is None or value is None:
            continue
        if isinstance(value, bool):
            value = int(value != flag.negated)
        out[flag.env] = str(value)
    shutdown = args.stall_check_shutdown_time_seconds
    warn = args.stall_check_warning_time_seconds or DEFAULT_STALL_WARNING_SECONDS
    deadline = SGP_OPTIONS["timeout"]
    if (shutdown and shutdown > warn and getattr(args, deadline.name, None) is None
            and deadline.env not in environ):
        out[deadline.env] = str(float(shutdown))
    return out
