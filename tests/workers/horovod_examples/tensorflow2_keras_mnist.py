"""Horovod 0.28.1's examples/tensorflow2/tensorflow2_keras_mnist.py, shortened for the tests, with
`import horovod.tensorflow.keras as hvd` replaced by fastxfer's import. Every Horovod call is the
example's: a Sequential without Input (built by its first batch), a legacy Adam wrapped in
DistributedOptimizer, compile(..., experimental_run_tf_function=False), BroadcastGlobalVariables-,
MetricAverage- and LearningRateWarmupCallback, checkpoints on rank 0.

Shortened: MNIST-shaped random data instead of the download (the machine is offline), batches of
32, 8 // size steps per epoch, 4 epochs. The example's version check reads tf.keras.__version__,
which tf-keras 2.21's tf.keras does not have; on every Keras >= 2.11 it picks the legacy
optimizers, imported directly here. The last block (marked) is test instrumentation.
"""

import numpy as np
import tensorflow as tf

import fastxfer.keras as hvd  # was: import horovod.tensorflow.keras as hvd
from tensorflow.keras.optimizers import legacy as optimizers


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process); none on this machine
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    # random MNIST-shaped images and labels, different on every rank (the example loads mnist-<rank>.npz)
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
    scaled_lr = 0.001 * hvd.size()
    opt = optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=['accuracy'],
                        experimental_run_tf_function=False)

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: warm the learning rate up from lr/size to lr over the first three epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of workers.
    history = mnist_model.fit(dataset, steps_per_epoch=8 // hvd.size(), callbacks=callbacks, epochs=4,
                              verbose=verbose)

    # -- test instrumentation (not in Horovod's example) --
    digest = float(sum(np.float64(np.sum(np.abs(w))) for w in mnist_model.get_weights()))
    print(f"FINAL rank {hvd.rank()} weights {digest!r} loss {history.history['loss'][-1]!r}", flush=True)


if __name__ == '__main__':
    main()
