"""Elastic training, framework-free (Horovod's ``horovod.common.elastic``): the state a job keeps
across a lost or added worker, and the ``run`` wrapper that restores it and re-forms the group.

Under ``fastxfer run -np N --min-np M`` (launch/elastic.py)::

    state = fastxfer.elastic.ObjectState(epoch=0, batch=0)

    @fastxfer.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                              # collectives
            state.commit()                   # every few steps: a copy to go back to

    train(state)

What happens when a peer dies: its survivors' next collective raises PeerFailureError (within a
second). ``run`` catches it, restores the last commit (``state.restore()``), leaves the old group
(``fastxfer.shutdown()``: its segment is unlinked, its requests fail) and joins the next
generation (``fastxfer.init()`` asks the launcher's rendezvous, which answers with the new rank
and size once every survivor has asked), runs the reset callbacks (learning-rate scaling, the
loader's re-sharding), broadcasts rank 0's state to everyone (``state.sync()``) and calls the
function again. A worker the launcher restarted (``--max-restarts``) waits in ``init()``; the
members learn of it at their next ``state.commit()`` (``check_host_updates`` raises
HostsUpdatedInterrupt on every rank at once) and re-form the group with it, without restoring:
the commit they just made is current, and the newcomer receives it in ``sync()``.

Outside an elastic launcher, ``run`` calls the function once: a failure is raised as usual.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import numpy as np

from fastxfer.comm import group, rendezvous
from fastxfer.errors import PeerFailureError


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank at a commit when workers wait to join: the group re-forms with them.
    ``skip_sync``: whether the state may skip the broadcast after the reset (never, here: a
    newcomer always needs the state)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("workers are waiting to join the group: re-forming it at this commit")
        self.skip_sync = skip_sync


def is_failure(e: BaseException) -> bool:
    """Whether `e` is a peer failure, as fastxfer raises it or as a framework wrapped it (a
    TensorFlow op error carrying "PeerFailureError: ..." in its message)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PeerFailureError):
            return True
        if "PeerFailureError:" in str(getattr(e, "message", "") or e):
            return True
        e = e.__cause__ or e.__context__
    return False


def reset() -> None:
    """Leave the current group and join the next generation with the same init() settings."""
    args = group.init_args()
    group.shutdown()
    group.init(**args)


class State:
    """What a job carries across a reset. Subclasses say how to save, restore and sync it.

    ``commit()`` saves a copy (``save()``) and checks whether workers wait to join; after a
    failure ``restore()`` goes back to the last commit; after every reset ``sync()`` makes every
    rank's state rank 0's, and the reset callbacks run (``register_reset_callbacks``)."""

    def __init__(self):
        self._reset_callbacks: list[Callable[[], None]] = []
        self._generation = None

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after every reset, before the state is synced: rescale
        the learning rate by the new size, re-shard the data."""
        if callable(callbacks):
            callbacks = [callbacks]
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (the point a failure goes back to), then check_host_updates()."""
        self.save()
        rendezvous.note_progress()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Collective: raises HostsUpdatedInterrupt on every rank when workers wait to join.
        Rank 0 asks the launcher and broadcasts its answer, so every rank decides alike."""
        if not rendezvous.is_elastic() or not group.is_initialized():
            return
        from fastxfer.comm import collectives

        flag = np.zeros(1, np.int64)
        if group.rank() == 0:
            flag[0] = 1 if rendezvous.poll()["pending"] else 0
        if group.size() > 1:
            flag = collectives.broadcast(flag, root=0, name="fastxfer.elastic.check_host_updates")
        if int(flag[0]):
            raise HostsUpdatedInterrupt(False)

    # what subclasses provide
    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the callbacks (subclasses drop what depends on the old group)."""


class ObjectState(State):
    """Picklable Python values as attributes: ``ObjectState(epoch=0, batch=0)``; ``state.epoch``
    is read and assigned like any attribute, ``commit()`` copies the values, ``sync()`` broadcasts
    rank 0's."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__()
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state and group.is_initialized() and group.size() > 1:
            bcast = self._bcast_object
            if bcast is None:
                from fastxfer.comm import collectives

                def bcast(obj):
                    return collectives.broadcast_object(obj, root=0, name="fastxfer.elastic.object_state")
            self._saved_state = bcast(self._saved_state)
        self._set_attrs()


def run_fn(func: Callable, reset_fn: Callable[[], None]) -> Callable:
    """``func(state, ...)`` run elastically, with ``reset_fn`` to leave and re-form the group."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"an elastic function's first argument must be its State, not {type(state).__name__}")
        if not group.is_initialized():
            group.init()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            except Exception as e:  # noqa: BLE001 - only peer failures are handled, the rest re-raised
                if not is_failure(e):
                    raise
                if not rendezvous.is_elastic():
                    raise
                state.restore()
                skip_sync = False
            _reset_quietly(reset_fn)
            state.on_reset()

    return wrapper


def _reset_quietly(reset_fn: Callable[[], None]) -> None:
    try:
        reset_fn()
    except PeerFailureError:
        # the old group's shutdown found its dead peer: the engine is gone all the same; join anew
        if group.is_initialized():
            raise
        group.init(**group.init_args())


def run(func: Callable) -> Callable:
    """Decorator: run ``func(state, ...)`` elastically (see the module docstring)."""
    return run_fn(func, reset)
