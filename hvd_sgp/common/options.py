"""SGP choices: keyword arguments win over HVD_SGP_* environment variables, which win over
defaults. Parsed and validated once, at optimizer construction."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.topology import TOPOLOGIES, Topology

MODES = ("sgp", "allreduce", "dpsgd")
COMPRESSIONS = ("none", "fp16", "bf16")


@dataclass
class SgpOptions:
    topology: Union[str, Topology] = "exponential"
    peers: int = 1
    push_sum: bool = True
    mode: str = "sgp"
    overlap: bool = False
    max_delay: int = 1
    schedule: Optional[str] = None
    timeout: float = 300.0
    metrics: Optional[str] = None
    metrics_every: int = 10

    def describe(self) -> tuple:
        """What every rank must agree on (compared across ranks at the first step)."""
        topo = self.topology if isinstance(self.topology, str) else repr(self.topology)
        return (topo, self.peers, self.push_sum, self.mode, self.overlap, self.max_delay,
                repr(self.schedule), self.metrics is not None, self.metrics_every)


_ENV = {
    "topology": "HVD_SGP_TOPOLOGY", "peers": "HVD_SGP_PEERS", "push_sum": "HVD_SGP_PUSH_SUM",
    "mode": "HVD_SGP_MODE", "overlap": "HVD_SGP_OVERLAP", "max_delay": "HVD_SGP_MAX_DELAY",
    "schedule": "HVD_SGP_SCHEDULE", "timeout": "HVD_SGP_TIMEOUT",
    "metrics": "HVD_SGP_METRICS", "metrics_every": "HVD_SGP_METRICS_EVERY",
}


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SgpValueError(f"{name}={raw!r} must be one of 1/0, true/false, yes/no, on/off")


def _parse_number(name: str, raw: str, kind: type, minimum: float) -> Any:
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise SgpValueError(f"{name}={raw!r} must be a {kind.__name__} >= {minimum}") from None
    if value < minimum:
        raise SgpValueError(f"{name}={raw!r} must be a {kind.__name__} >= {minimum}")
    return value


def resolve(**given: Any) -> SgpOptions:
    """Options from keywords (None = not given), then the environment, then the defaults."""
    values = {}
    for f in fields(SgpOptions):
        keyword = given.pop(f.name, None)
        env = os.environ.get(_ENV[f.name])
        if keyword is not None:
            values[f.name], source = keyword, f.name
        elif env is not None and env.strip() != "":
            values[f.name], source = env, _ENV[f.name]
        else:
            continue
        values[f.name] = _coerce(f.name, source, values[f.name])
    if given:
        raise SgpValueError(f"unknown SGP option(s) {sorted(given)}")
    options = SgpOptions(**values)
    if isinstance(options.topology, str) and options.topology.lower() not in TOPOLOGIES:
        raise SgpValueError(f"topology {options.topology!r} is unknown; choose one of "
                            f"{sorted(TOPOLOGIES)} or pass a Topology object")
    if options.mode not in MODES:
        raise SgpValueError(f"mode {options.mode!r} is unknown; choose one of {MODES}")
    return options


def _coerce(name: str, source: str, value: Any) -> Any:
    if name in ("push_sum", "overlap"):
        return value if isinstance(value, bool) else _parse_bool(source, str(value))
    if name in ("peers", "max_delay", "metrics_every"):
        return _parse_number(source, value, int, 1)
    if name == "timeout":
        return _parse_number(source, value, float, 1e-3)
    if name == "mode":
        return str(value).strip().lower()
    return value
