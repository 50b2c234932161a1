"""A worker of ``fastxfer bench elastic``: a small Keras 3 CNN trained in a tf.function loop with
DistributedGradientTape, under fastxfer's elastic.run with a TensorFlowKerasState committed every
step. Writes one JSON line per event to OUT/events.<worker> (time.monotonic(), the same clock in
every process of the machine): "step" (generation, size, steps done) after every step, "reset"
from the reset callback (the group has re-formed), "pid" at start."""

from __future__ import annotations

import argparse
import json
import os
import time

from fastxfer import settings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--plain", action="store_true", help="no elastic.run: a plain job (the restart peer)")
    a = p.parse_args()
    worker = settings.get("FASTXFER_WORKER_ID")
    if worker is None:  # a plain run: the rank
        worker = settings.get("FASTXFER_RANK") or 0
    log = open(os.path.join(a.out, f"events.{worker}"), "a", buffering=1)

    def event(kind, **kw):
        log.write(json.dumps({"t": time.monotonic(), "ev": kind, **kw}) + "\n")

    event("pid", pid=os.getpid())
    import keras
    import numpy as np
    import tensorflow as tf

    import fastxfer.tensorflow as hvd
    from fastxfer.comm import group

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
                              keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(int(worker))
    x = tf.constant(rng.standard_normal((a.batch, 32, 32, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, a.batch).astype(np.int32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def loop(state, commit):
        while state.steps < a.steps:
            step()
            state.steps += 1
            event("step", gen=group.layout().generation, size=hvd.size(), steps=state.steps)
            commit()

    if a.plain:
        loop(hvd.elastic.ObjectState(steps=0), lambda: None)
        return
    state = hvd.elastic.TensorFlowKerasState(model, optimizer=opt, steps=0)
    state.register_reset_callbacks([lambda: event("reset", gen=group.layout().generation)])
    hvd.elastic.run(lambda state: loop(state, state.commit))(state)


if __name__ == "__main__":
    main()
