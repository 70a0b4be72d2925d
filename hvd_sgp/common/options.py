"""The one table of SGP options.

Each option is declared once, in ``OPTIONS``: its keyword, type, default, ``HVD_SGP_*``
variable, ``sgprun`` flag and help. The ``SgpOptions`` record, the environment map, the
optimizers' keyword checks and sgprun's flags are all generated from it, so a new option is
one ``Option(...)`` line plus the code that acts on it. Keywords win over variables, which win
over defaults; everything is parsed and validated once, at optimizer construction.
"""
from __future__ import annotations

import dataclasses
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from hvd_sgp.common import outer_steps
from hvd_sgp.common.errors import OptionError
from hvd_sgp.common.topology import TOPOLOGIES, Topology

MODES = ("sgp", "allreduce", "dpsgd")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_HOLDS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


@dataclass(frozen=True)
class Option:
    """One SGP choice. ``keyword=False`` marks a launch-level option (read by the runtime,
    not a DistributedOptimizer keyword). ``agree`` says what every rank must share: the
    value, only whether it is set, or nothing (a per-rank choice such as a timeout)."""

    name: str
    kind: type  # str, int, float or bool
    default: Any
    help: str
    choices: tuple = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    above: Optional[float] = None  # an exclusive lower bound
    objects: Optional[type] = None  # keyword values of this type are taken as they are
    keyword: bool = True
    agree: str = "value"  # "value" | "presence" | "none"
    metavar: Optional[str] = None
    aliases: tuple = ()  # more sgprun spellings (horovodrun's)
    check: Optional[Callable[[str, str], object]] = None  # validates a string (value, source)

    @property
    def env(self) -> str:
        return "HVD_SGP_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any, source: str) -> Any:
        """``value`` (a keyword's value or a variable's text) as this option's type, checked;
        ``source`` names where it came from in the error."""
        if self.objects is not None and isinstance(value, self.objects):
            return value
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in _TRUE + _FALSE:
                raise OptionError(f"{source}={value!r} must be one of 1/0, true/false, "
                                    "yes/no, on/off")
            return text in _TRUE
        if self.kind in (int, float):
            try:
                number = self.kind(value)
                if isinstance(value, bool) or (self.kind is int and number != float(value)):
                    raise ValueError
            except (TypeError, ValueError):
                number = None
            limits = [(sign, limit) for sign, limit in (
                (">=", self.minimum), (">", self.above), ("<=", self.maximum)) if limit is not None]
            if number is None or not all(_HOLDS[sign](number, limit) for sign, limit in limits):
                bound = "".join((" and " if i else " ") + f"{sign} {limit:g}"
                                for i, (sign, limit) in enumerate(limits))
                raise OptionError(f"{source}={value!r} must be a{'n' if self.kind is int else ''}"
                                    f" {self.kind.__name__}{bound}")
            return number
        if not isinstance(value, str):
            kinds = "a string" + (f" or a {self.objects.__name__}" if self.objects else "")
            raise OptionError(f"{source}={value!r} must be {kinds}")
        if self.choices:
            value = value.strip().lower()
            if value not in self.choices:
                raise OptionError(f"{source}={value!r} is unknown; choose one of "
                                    f"{', '.join(self.choices)}")
        if self.check is not None:
            self.check(value, source)
        return value


OPTIONS: tuple[Option, ...] = (
    Option("topology", str, "exponential", "gossip graph", choices=tuple(sorted(TOPOLOGIES)),
           objects=Topology),
    Option("peers", int, 1, "out-peers per iteration", minimum=1),
    Option("push_sum", bool, True, "de-bias by the PushSum weight (off: the ablation)"),
    Option("mode", str, "sgp", "exchange after each local step", choices=MODES),
    Option("overlap", bool, False, "overlap gossip with computation (Overlap SGP)"),
    Option("max_delay", int, 1, "iterations a message may lag with overlap (tau); with "
           "local_steps > 1, steps an outer step lands after its round", minimum=1),
    Option("schedule", str, None, "exchange schedule, e.g. '0:allreduce,30:sgp2,60:sgp1'"),
    Option("timeout", float, 300.0, "seconds to wait on a silent peer before failing",
           minimum=1e-3, agree="none"),
    Option("error_feedback", bool, True, "int8/top-k gossip sends later what the codec "
           "dropped (off: the ablation; random-k drops nothing)"),
    Option("consensus_step", float, None, "int8/top-k gossip's consensus step gamma, in (0, 1] "
           "(default: the codec's)", above=0, maximum=1),
    Option("local_steps", int, 1, "local steps per exchange (Local SGD); SlowMo's period",
           minimum=1),
    Option("slowmo", float, None, "SlowMo's slow momentum beta, in [0, 1]: exact average and "
           "outer update every local_steps steps", minimum=0, maximum=1),
    Option("slowmo_lr", float, 1.0, "SlowMo's outer learning rate alpha", above=0),
    Option("outer_optimizer", str, None, "outer step on the pseudo-gradient (model at the last "
           "sync minus the averaged model) every local_steps steps, averaged exactly "
           "(mode=allreduce, DiLoCo) or by one PushSum round (mode=sgp): diloco, "
           "nesterov:LR:MU, heavyball:LR:MU, sgd:LR (torch: also an optimizer factory; Keras: an "
           "optimizer or a factory)",
           objects=outer_steps.OuterStep, check=outer_steps.parse, metavar="SPEC"),
    Option("outer_fragments", int, 1, "streaming outer steps: the model in this many fragments, "
           "fragment p syncing at the steps congruent to p*local_steps//P modulo local_steps "
           "(peak bytes per step fall P-fold); at most local_steps", minimum=1),
    Option("samples_per_step", int, None, "this rank's training samples per step, where ranks "
           "differ (uneven workers: a slower rank given a smaller batch): gradients and "
           "local updates are weighted by the samples behind them; set on every rank or none",
           minimum=1, agree="presence"),
    Option("metrics", str, None, "append consensus metrics as JSON lines to this file",
           agree="presence", metavar="PATH"),
    Option("metrics_every", int, 10, "steps between metrics records", minimum=1),
    Option("local_size", int, None, "ranks per SGP node; 1 makes every rank a node",
           minimum=1, keyword=False),
    Option("fault_tolerant", bool, False, "survive lost ranks (ULFM): the survivors repair the "
           "world in place and go on", keyword=False),
    Option("min_np", int, 1, "fault-tolerant: end the job when fewer ranks survive",
           minimum=1, keyword=False, aliases=("--min-num-proc",)),
    Option("max_np", int, None, "fault-tolerant: replace lost ranks with fresh processes "
           "(MPI_Comm_spawn, under hvd.elastic.run) until the world has this many again",
           minimum=1, keyword=False, aliases=("--max-num-proc",)),
    Option("spares", int, 0, "fault-tolerant, with max_np or host discovery: keep this many "
           "warm spares (spawned ahead, their imports done) to replace lost ranks in a "
           "fraction of a spawn's time", minimum=0, keyword=False),
    Option("replace_at", str, "ready", "fault-tolerant, with max_np or host discovery: "
           "replacements for lost ranks start at the repair and join at the first "
           "state.commit() at which they are ready (ready: the survivors train on while they "
           "start), at the next commit (commit), or inside the repair (repair: the survivors "
           "wait for them)", choices=("ready", "commit", "repair"), keyword=False),
    Option("host_discovery_script", str, None, "fault-tolerant: a command printing the "
           "hosts that may run ranks, one host:slots line each (horovodrun's); sgprun starts "
           "on what it finds, rank 0 runs it again every discovery_interval and the world "
           "grows or shrinks to it at a state.commit()", keyword=False, metavar="COMMAND"),
    Option("slots_per_host", int, None, "slots of a host the discovery script prints "
           "without :slots", minimum=1, keyword=False),
    Option("discovery_interval", float, 1.0, "seconds between runs of the discovery script "
           "(Horovod's period)", above=0, keyword=False),
    Option("elastic_timeout", float, 600.0, "seconds the discovery script may take to find "
           "enough slots: -np before the launch, --min-np while the job runs (Horovod's "
           "HOROVOD_ELASTIC_TIMEOUT)",
           above=0, keyword=False),
    Option("detector_timeout", float, 8.0, "fault-tolerant: seconds of silence before ULFM "
           "declares a rank dead", minimum=0.1, keyword=False),
    Option("elastic_restore", str, "keep", "after a lost rank, hvd.elastic.run keeps the "
           "survivors' averaged parameters (keep) or reloads the last commit (commit)",
           choices=("keep", "commit"), keyword=False),
    Option("compression", str, "none", "gossip codec where the script asks for none (Horovod's "
           "compression= wins): none, fp16, bf16, int8, int4, int2, topk:F, randomk:F",
           keyword=False, metavar="CODEC"),
)
BY_NAME = {o.name: o for o in OPTIONS}
KEYWORDS = tuple(o.name for o in OPTIONS if o.keyword)


def _describe(self) -> tuple:
    """What every rank must agree on (compared across ranks when the engine starts)."""
    out = []
    for name in KEYWORDS:
        option, value = BY_NAME[name], getattr(self, name)
        if option.agree == "value":
            out.append(value if isinstance(value, (str, int, float, type(None))) else repr(value))
        elif option.agree == "presence":
            out.append(value is not None)
    return tuple(out)


SgpOptions = dataclasses.make_dataclass(
    "SgpOptions", [(name, Any, dataclasses.field(default=BY_NAME[name].default))
                   for name in KEYWORDS],
    namespace={"describe": _describe, "__module__": __name__,
               "__doc__": "The resolved SGP choices of one optimizer (see OPTIONS)."})


def from_environment(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """One option's value from its variable, or its default when unset or empty."""
    option = BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(option.env, "")
    return option.parse(raw, option.env) if raw.strip() else option.default


def resolve(**given: Any) -> "SgpOptions":
    """Options from keywords (None = not given), then the environment, then the defaults."""
    unknown = sorted(set(given) - set(KEYWORDS))
    if unknown:
        raise OptionError(f"unknown SGP option(s) {unknown}; the options are "
                            f"{', '.join(KEYWORDS)}")
    values = {}
    for name in KEYWORDS:
        option = BY_NAME[name]
        keyword = given.get(name)
        values[name] = (option.parse(keyword, name) if keyword is not None
                        else from_environment(name))
    return SgpOptions(**values)


def keyword_help() -> str:
    """The SGP keywords, one line each (appended to the optimizers' docstrings)."""
    return "\n".join(f"    {o.name}: {o.help} (default {o.default!r}; {o.env})"
                     for o in OPTIONS if o.keyword)


def environment(chosen: Mapping[str, Any]) -> dict[str, str]:
    """``{HVD_SGP_*: text}`` for the options given in ``chosen`` (None = not given), as the
    launcher passes them to every rank."""
    out = {}
    for option in OPTIONS:
        value = chosen.get(option.name)
        if value is not None:
            out[option.env] = str(int(value)) if option.kind is bool else str(value)
    return out
