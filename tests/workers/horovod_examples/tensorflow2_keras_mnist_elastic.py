"""Horovod 0.28.1's examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py, shortened for
the tests, with `import horovod.tensorflow.keras as hvd` replaced by fastxfer's import. Every
Horovod call is the example's: a Sequential without Input (built by its first batch), Adadelta
scaled by size() wrapped in DistributedOptimizer, compile(..., experimental_run_tf_function=False),
KerasState(model, batch=..., epoch=0) with a reset callback that rescales the learning rate with
tf.keras.backend.set_value(optimizer.lr, ...), MetricAverageCallback and the three elastic
callbacks, checkpoints on rank 0, and fit() inside @hvd.elastic.run with
steps_per_epoch=N // size() and epochs=E - state.epoch.

Shortened: MNIST-shaped random data instead of the download (the machine is offline), batches of
32, 24 // size steps per epoch, 4 epochs, KerasState(batch=0). Run with tf-keras
(TF_USE_LEGACY_KERAS=1): the example's `optimizer.lr` is Keras 2's. The marked blocks are test
instrumentation: a worker named by $KILL_WORKER kills itself with SIGKILL after $KILL_AFTER batches.
"""

import os
import signal

import numpy as np
import tensorflow as tf

import fastxfer.keras as hvd  # was: import horovod.tensorflow.keras as hvd


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process); none on this machine
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    # random MNIST-shaped images and labels (the example loads mnist-<rank>.npz)
    rng = np.random.default_rng(hvd.rank())
    images = rng.integers(0, 256, size=(512, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(512,), dtype=np.int64)
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(1000).batch(32)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax'),
    ])

    # Horovod: adjust learning rate based on number of workers.
    lr = 1.0
    scaled_lr = lr * hvd.size()
    opt = tf.optimizers.Adadelta(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=['accuracy'],
                        experimental_run_tf_function=False)

    def on_state_reset():
        tf.keras.backend.set_value(state.model.optimizer.lr, lr * hvd.size())

    state = hvd.elastic.KerasState(mnist_model, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    callbacks = [
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: elastic callbacks keep the state's epoch and batch, and commit it every batch.
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # -- test instrumentation (not in Horovod's example) --
    class KillAfter(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if os.environ.get("FASTXFER_WORKER_ID") == os.environ.get("KILL_WORKER") and \
                    self.batches == int(os.environ.get("KILL_AFTER", "0")):
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks.append(KillAfter())
    # -- end of instrumentation --

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=24 // hvd.size(), callbacks=callbacks, epochs=4 - state.epoch,
                        verbose=verbose)

    train(state)

    # -- test instrumentation (not in Horovod's example) --
    digest = float(sum(np.float64(np.sum(np.abs(w))) for w in mnist_model.get_weights()))
    print(f"FINAL rank {hvd.rank()} size {hvd.size()} epoch {state.epoch} lr "
          f"{float(tf.keras.backend.get_value(opt.lr))!r} weights {digest!r}", flush=True)


if __name__ == '__main__':
    main()
