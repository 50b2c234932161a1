"""Overlap of gradient reduction with the backward pass: pins each gradient's submit op into the
traced backward pass with control edges (FASTXFER_TF_PIN), without ever closing a cycle."""

from __future__ import annotations

import os

import tensorflow as tf

from fastxfer import settings

# fastxfer's own submit and wait ops (native, or tf.numpy_function / tf.py_function host callbacks):
# never given an edge
_HOST_CALLBACKS = ("PyFunc", "EagerPyFunc", "FastxferSubmit", "FastxferWait", "FastxferWaitGather")


def pin_enabled() -> bool:
    """FASTXFER_TF_PIN: 1 always pin submits into the backward pass, 0 never, auto (default) when
    the engine has CPU time of its own -- this process may run on more CPUs than TensorFlow's
    intra-op threads use, or the engine thread is pinned to cores (FASTXFER_ENGINE_CPUS). With no
    spare core, an overlapped engine only time-slices with the backward pass on the same core and
    pinning costs time (measured: bench/RESULTS.md)."""
    mode = settings.get("FASTXFER_TF_PIN")
    if mode != "auto":
        return bool(mode)
    if settings.get("FASTXFER_ENGINE_CPUS"):
        return True
    cpus = len(os.sched_getaffinity(0))
    intra = tf.config.threading.get_intra_op_parallelism_threads() or cpus
    return cpus > intra


def _op_id(op) -> int:
    return op._id  # creation order within the graph  # noqa: SLF001


def _reaches(src, target, floor: int) -> bool:
    """Is `src` an ancestor of `target`? Searches target's ancestors with creation id >= floor
    (inputs are created before their consumers, so a path from src only passes ops created after
    src, except through control edges this module added, whose targets are all >= floor)."""
    stack, seen = [target], set()
    while stack:
        op = stack.pop()
        if op is src:
            return True
        for p in [t.op for t in op.inputs] + list(op.control_inputs):
            if p.graph is target.graph and _op_id(p) >= floor and _op_id(p) not in seen:
                seen.add(_op_id(p))
                stack.append(p)
    return False


def pin_to_backward(graph, grads, submits) -> None:
    """Overlap for real: TensorFlow's executor would let a ready submit wait behind the rest of the
    backward pass (its inter-op queues run the next layer's matmuls first). So each op that
    continues the backward pass from a gradient's inputs -- the other consumers of the tensors the
    gradient was computed from, e.g. the input-gradient matmul of the same layer -- gets a control
    edge from that gradient's submit: the backward pass goes on once the gradient is with the
    engine. An edge is added only where it cannot close a cycle: the consumer must not be an
    ancestor of the submit (whose ancestors are all earlier gradients and submits).

    `grads` and `submits` (the submit ops' outputs) pair up, in submission order; gradients that
    belong to another graph than `graph` (the one being traced) are left alone."""
    floor = None  # lowest creation id among ops given an edge here
    for g, sub in zip(grads, submits):
        if g.graph is not graph:
            continue
        sop = sub.op
        for t in g.op.inputs:
            for c in t.consumers():
                if c is g.op or c.graph is not graph or c.type in _HOST_CALLBACKS or sop in c.control_inputs:
                    continue
                lo = _op_id(c) if floor is None else min(floor, _op_id(c))
                if _reaches(c, sop, lo):
                    continue
                c._add_control_input(sop)  # noqa: SLF001
                floor = lo
