"""Horovod 0.28.1's examples/tensorflow2/tensorflow2_mnist.py, shortened for the tests, with
`import horovod.tensorflow as hvd` replaced by fastxfer's import. Every Horovod call is the
example's: a custom tf.function training step with DistributedGradientTape, broadcast_variables
of the model's and the optimizer's variables after the first step, a tf.train.Checkpoint on rank 0.

Shortened: MNIST-shaped random data instead of the download, batches of 32, 16 // size steps. It
calls ``opt.variables()``, which works on tf-keras optimizers (TF_USE_LEGACY_KERAS=1) and not on
Keras 3's, whose ``variables`` is a list. The last block (marked) is test instrumentation.
"""

import numpy as np
import tensorflow as tf

import fastxfer.tensorflow as hvd  # was: import horovod.tensorflow as hvd

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process); none on this machine
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

rng = np.random.default_rng(hvd.rank())  # the example loads mnist-<rank>.npz
mnist_images = rng.integers(0, 256, size=(256, 28, 28), dtype=np.uint8)
mnist_labels = rng.integers(0, 10, size=(256,), dtype=np.int64)

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(mnist_labels, tf.int64)))
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
loss = tf.losses.SparseCategoricalCrossentropy()

# Horovod: adjust learning rate based on number of workers.
opt = tf.optimizers.Adam(0.001 * hvd.size())

checkpoint_dir = './checkpoints'
checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes, after the
    # first gradient step so that the optimizer's variables exist.
    if first_batch:
        hvd.broadcast_variables(mnist_model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)

    return loss_value


# Horovod: adjust number of steps based on number of workers.
for batch, (images, labels) in enumerate(dataset.take(16 // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)

    if batch % 4 == 0 and hvd.local_rank() == 0:
        print('Step #%d\tLoss: %.6f' % (batch, loss_value))

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting it.
if hvd.rank() == 0:
    checkpoint.save(checkpoint_dir)

# -- test instrumentation (not in Horovod's example) --
digest = float(sum(np.float64(np.sum(np.abs(w.numpy()))) for w in mnist_model.variables))
print(f"FINAL rank {hvd.rank()} weights {digest!r}", flush=True)
