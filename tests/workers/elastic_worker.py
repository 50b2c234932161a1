"""Workers of elastic jobs (tests/multiproc/test_elastic.py).

usage: elastic_worker.py MODE OUTDIR

MODE
  loop       a TensorFlow training loop (tf.function step, DistributedGradientTape, a Keras 3 model)
             on a fastxfer.data Loader over the pack in $PACK, with TensorFlowKerasState(model,
             optimizer, epoch, start): rank 0 writes OUTDIR/resume_g<generation>.npz whenever
             training (re)starts and OUTDIR/final.npz at the end.
  reference  the same loop in a plain job (no elastic), from $RESUME (a resume_g*.npz) to the end:
             OUTDIR/final_ref.npz.
  keras      model.fit with KerasState and Horovod's three elastic callbacks (Keras 3, or tf-keras
             with TF_USE_LEGACY_KERAS=1), a reset callback that scales the learning rate by size().

$KILLS: failures to inject, comma-separated "WORKER@WHEN" with WHEN one of
  stepN    after the N-th training step (counted in the state: epoch * steps + batch)
  commitN  inside the commit at step N, after the state is saved, before check_host_updates
  resetN   in this worker's N-th reset callback (a failure while the group re-forms)
Only the first workers (ids below -np) fail; restarted ones (--max-restarts) never do.
$HOLD_FOR_NEWCOMER (loop): in generation 1, rank 0 waits until a restarted worker asks to join.

Every worker that finishes prints "FINAL worker W rank R size S generation G epoch E digest D"
(D: a digest of the model's weights and the optimizer's variables).
"""

import hashlib
import os
import signal
import sys
import time

import numpy as np

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
if LEGACY:
    import tf_keras as keras
else:
    import keras
import tensorflow as tf

import fastxfer.keras as hvd
import fastxfer.tensorflow as hvd_tf
from fastxfer.comm import group

MODE, OUT = sys.argv[1], sys.argv[2]
WORKER = int(os.environ.get("FASTXFER_WORKER_ID", "-1"))
STEPS, EPOCHS, BATCH, BASE_LR = 6, 3, 8, 0.05
KILLS = {}
for item in filter(None, os.environ.get("KILLS", "").split(",")):
    w, _, when = item.partition("@")
    KILLS.setdefault(int(w), []).append(when)
resets = 0


def maybe_die(kind: str, n: int) -> None:
    if f"{kind}{n}" in KILLS.get(WORKER, []):
        print(f"worker {WORKER} dies at {kind} {n}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for v in list(model.weights) + opt_variables(opt):
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()[:16]


def opt_variables(opt):
    vs = opt.variables
    return list(vs() if callable(vs) else vs)


def make_model(input_shape):
    keras.utils.set_random_seed(1234 + (WORKER if MODE == "keras" else 0))  # keras: ranks start apart
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    return model


def save_npz(path, model, opt, **extra):
    arrays = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    arrays.update({f"o{i}": v.numpy() for i, v in enumerate(opt_variables(opt))})
    np.savez(path, **arrays, **{k: np.array(v) for k, v in extra.items()})


def loop_mode():
    from fastxfer.data import Loader

    hvd.init()
    loader = Loader(os.environ["PACK"], batch_size=4, image_size=8, threads=1, seed=7, decoder="auto")
    model = make_model((8, 8, 3))
    opt = keras.optimizers.SGD(BASE_LR, momentum=0.9)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def epochs(state, commit):
        while state.epoch < 2:
            loader.resume(state.epoch, state.start)
            for x, y in loader:
                step(tf.constant(x), tf.constant(y))
                state.start += loader.global_batch
                state.steps += 1
                maybe_die("step", state.steps)
                commit()
            state.epoch += 1
            state.start = 0
            commit()

    if MODE == "reference":
        ref = np.load(os.environ["RESUME"])
        for i, v in enumerate(model.weights):
            v.assign(ref[f"w{i}"])
        for i, v in enumerate(opt_variables(opt)):
            v.assign(ref[f"o{i}"])
        state = hvd.elastic.ObjectState(epoch=int(ref["epoch"]), start=int(ref["start"]), steps=int(ref["steps"]))
        assert hvd.size() == int(ref["size"]), (hvd.size(), int(ref["size"]))
        epochs(state, lambda: None)
        if hvd.rank() == 0:
            save_npz(os.path.join(OUT, "final_ref.npz"), model, opt)
        return report(model, opt, state)

    state = hvd_tf.elastic.TensorFlowKerasState(model, optimizer=opt, epoch=0, start=0, steps=0)
    state.register_reset_callbacks([on_reset])

    @hvd_tf.elastic.run
    def train(state):
        if os.environ.get("HOLD_FOR_NEWCOMER") and group.layout().generation == 1 and hvd.rank() == 0:
            # test instrumentation: after the failure, train only once the restarted worker waits to
            # join, so that it joins at this generation's first commit whatever the machine's speed
            from fastxfer.comm import rendezvous

            deadline = time.monotonic() + 240
            while not rendezvous.poll()["pending"] and time.monotonic() < deadline:
                time.sleep(0.1)
        if hvd.rank() == 0:
            save_npz(os.path.join(OUT, f"resume_g{group.layout().generation}.npz"), model, opt, epoch=state.epoch,
                     start=state.start, steps=state.steps, size=hvd.size())
        epochs(state, state.commit)

    train(state)
    if hvd.rank() == 0:
        save_npz(os.path.join(OUT, "final.npz"), model, opt)
    report(model, opt, state)


def on_reset():
    global resets
    resets += 1
    maybe_die("reset", resets)


def report(model, opt, state):
    print(f"FINAL worker {WORKER} rank {hvd.rank()} size {hvd.size()} generation {group.layout().generation} "
          f"epoch {state.epoch} digest {digest(model, opt)}", flush=True)


class Steps(keras.callbacks.Callback):
    """Prints, at each epoch's end, how many batches this fit trained in it and from which batch it
    started; injects the step failures (after the update callbacks have counted the batch)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        self.first, self.count = self.state.batch, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.count += 1

    def on_train_batch_end(self, batch, logs=None):
        maybe_die("step", self.state.epoch * STEPS + self.state.batch)

    def on_epoch_end(self, epoch, logs=None):
        print(f"EPOCH {self.state.epoch} size {hvd.size()} first {self.first} trained {self.count}", flush=True)


def keras_mode():
    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    model = make_model((6,))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(BASE_LR * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    save = state.save

    def save_then_maybe_die():
        save()
        maybe_die("commit", state.epoch * STEPS + state.batch)

    state.save = save_then_maybe_die

    def scale_lr():
        opt.learning_rate.assign(BASE_LR * hvd.size())

    state.register_reset_callbacks([on_reset, scale_lr])
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), Steps(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)

    train(state)
    lr = float(np.asarray(opt.learning_rate.numpy() if hasattr(opt.learning_rate, "numpy") else opt.learning_rate))
    assert abs(lr - BASE_LR * hvd.size()) < 1e-7, (lr, hvd.size())
    report(model, opt, state)


if __name__ == "__main__":
    {"loop": loop_mode, "reference": loop_mode, "keras": keras_mode}[MODE]()
