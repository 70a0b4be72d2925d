"""Horovod's elastic API, written once for every framework: the state objects and the run loop.

``hvd.elastic.run(train)(state)`` syncs the state (rank 0's everywhere) and calls ``train``.
When a rank is lost (fault-tolerant mode), ``train`` ends with HorovodInternalError on every
survivor; the loop then repairs the world in place (runtime.repair: the same processes, fewer
of them; ``hvd.size()`` and ``hvd.rank()`` report the new world), recovers the state, calls
the reset callbacks, syncs and calls ``train`` again. With HVD_SGP_MAX_NP the lost ranks'
replacements start at the repair (as warm spares) and join at the first ``state.commit()``
at which they are ready, which raises HostsUpdatedInterrupt on every rank; the loop takes
them in (runtime.replace), calls the reset callbacks and syncs (a replacement, running the
script from the top, joins there, at its first sync). HVD_SGP_REPLACE_AT=commit takes them in
at the next commit, ready or not; =repair in the repair, before the survivors go on. With
host discovery, ``state.commit()`` raises HostsUpdatedInterrupt on every rank at the same
commit when the hosts changed; the loop then lays the world out for them (runtime.resize:
ranks on removed hosts leave with status 0, newcomers are spawned on added ones), calls the
reset callbacks, syncs unless ranks only left (Horovod's ``skip_sync``) and calls ``train``
again, without a recovery. Without fault tolerance a lost
rank still ends the job (its error is a PeerTimeoutError, not a HorovodInternalError), and
the loop costs nothing.

Recovery: Horovod reloads the last commit. For SGP that throws away the steps since the
commit although the repair has just folded the survivors' models into their exact average,
so by default (HVD_SGP_ELASTIC_RESTORE=keep) the model and optimizer keep their current,
averaged values and only the rest of the state (counters, samplers, plain attributes) goes
back to the commit; ``commit`` reloads everything, as Horovod does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

from hvd_sgp.common import discovery, options, recovery, runtime
from hvd_sgp.common.errors import (HorovodInternalError, HostsUpdatedInterrupt, PeerLostError,
                                   PeerTimeoutError)


class State:
    """What a training function's progress is made of: committed to host memory now and then,
    restored after a failure, and synced from rank 0 before training (re)starts."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after every reset (a rank lost or hosts changed), e.g. to scale
        the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state to host memory (a copy), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank at once when the discovery script's hosts
        changed (rank 0's latest result is broadcast: one small collective per call).
        ``skip_sync`` when ranks only leave (Horovod's: when hosts were only removed): the
        ranks that stay hold the same state, and no newcomer waits for a sync. Also when
        replacements for lost ranks are ready to join (HVD_SGP_REPLACE_AT; one small
        collective per call while they are due). Otherwise, without host discovery, nothing
        is communicated."""
        if not runtime.is_initialized():
            return
        if runtime.discovering():
            change = runtime.hosts_changed(self._bcast_object(_latest_hosts()))
            if change:
                raise HostsUpdatedInterrupt(skip_sync=change == discovery.REMOVED)
        if runtime.replacements_due() and runtime.replacements_ready():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit, undoing what changed since."""
        raise NotImplementedError

    def recover(self) -> None:
        """After a lost rank: what ``run`` restores (see the module docstring)."""
        self.restore()

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Framework hook before the reset callbacks."""


class ObjectState(State):
    """State of plain Python values, given as keywords and kept as attributes."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class StateHandler:
    """Commit, restore and sync of one framework object (a model, an optimizer, a sampler).
    ``parameters`` marks what the SGP repair already brings to the survivors' average."""

    parameters = False

    def __init__(self, value: Any):
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class HandledState(ObjectState):
    """ObjectState whose keywords of known framework types (``registry``: (type, handler
    class) pairs) are committed, restored and synced by their handlers."""

    def __init__(self, registry: Iterable[tuple[type, type]], bcast_object: Callable,
                 get_rank: Callable[[], int], **kwargs: Any):
        registry = list(registry)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = next((cls(value) for kind, cls in registry if isinstance(value, kind)),
                           None)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object, get_rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def recover(self) -> None:
        keep = keeps_parameters()
        for handler in self._handlers.values():
            if not (keep and handler.parameters):
                handler.restore()
        ObjectState.restore(self)

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()


def _latest_hosts() -> Optional[list]:
    """On the world's rank 0, the discovery script's latest hosts (its poller starts on first
    call, and stops on a process that is no longer rank 0); None elsewhere."""
    if runtime.rank() != 0:
        discovery.stop_polling()
        return None
    return discovery.poll(*(options.from_environment(name) for name in (
        "host_discovery_script", "slots_per_host", "discovery_interval", "min_np",
        "elastic_timeout"))).latest()


def keeps_parameters() -> bool:
    """After a lost rank, models and optimizers keep their repaired values (the default,
    HVD_SGP_ELASTIC_RESTORE=keep) rather than reload the commit."""
    return options.from_environment("elastic_restore") == "keep"


def reset_gossip(optimizer: Any) -> None:
    """After a sync made every rank's parameters rank 0's: an SGP optimizer's PushSum weights
    become 1 and its messages in flight are dropped (the exact state of a consensus). An
    engine not running has nothing to reset: a new one starts with weight 1, and so does a
    survivor's successor after replacements joined (repair.Repair.retire); it starts at the next
    use, on every rank alike (a replacement's optimizer may not even be built yet)."""
    session = getattr(optimizer, "_sgp_session", None)
    if session is not None and session().started:
        session().engine.repair.reset_weights()


def _peer_failure(error: HorovodInternalError) -> bool:
    """A lost or silent peer, which a repair mends; not an error alike on every rank (ranks
    that disagreed on a collective), which would come back after any number of repairs."""
    return isinstance(error, (PeerLostError, PeerTimeoutError)) or recovery.failure_pending()


def run_fn(func: Callable[..., Any],
           wrap_errors: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
           ) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run`` decorator. ``wrap_errors`` lets a framework turn its own
    wrapping of a failure (TF op errors) into HorovodInternalError."""
    body = wrap_errors(func) if wrap_errors is not None else func

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        repair = recover = reset = skip_sync = take_in = False
        with recovery.elastic_scope():
            while True:
                try:
                    if repair:
                        runtime.repair(realign=False)
                        repair = False
                    if runtime.is_initialized() and runtime.resize_pending():
                        if runtime.resize():
                            recovery.leave_by_plan(f"the discovery script removed its host "
                                                   f"{runtime.host()!r} or slot")
                    if take_in:  # (a commit's, never a repair's: the survivors go on first)
                        take_in = False
                        if runtime.replacements_due():
                            runtime.replace()
                    if recover:
                        state.recover()
                        recover = False
                    if reset:
                        state.on_reset()
                        reset = False
                    if not skip_sync:
                        state.sync()
                    return body(state, *args, **kwargs)
                except HorovodInternalError as error:
                    if not recovery.enabled() or not _peer_failure(error):
                        raise  # nothing to repair: the world is gone, or no peer failed
                    repair = recover = reset = True
                    skip_sync = take_in = False
                except HostsUpdatedInterrupt as interrupt:  # (resize, take-in: loop's top)
                    reset, skip_sync, take_in = True, interrupt.skip_sync, True
    return wrapper
