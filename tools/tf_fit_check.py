"""A 2-rank Keras `fit` with fastxfer's DistributedOptimizer on the installed TensorFlow (run it
through `fastxfer run -np 2`): the ranks train different shards and must end with identical weights,
through the native op library (not the numpy_function bridge). Rank 0 prints one line:
`tf X keras Y: fit ok, identical weights, native ops` or raises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer.keras as hvd  # noqa: E402
from fastxfer.tensorflow import native  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert size == 2, size
rng = np.random.default_rng(rank)
x = rng.standard_normal((256, 8, 8, 1)).astype("float32")
y = (x.reshape(256, -1).sum(1) > 0).astype("int32")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(2)])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=hvd.Compression.bf16)
model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
every = hvd.allgather(w[None]).numpy()
assert (every == every[0]).all(), "the ranks' weights differ"
assert native.library() is not None, f"the native ops did not load: {native.reason()}"
if rank == 0:
    print(f"tf {tf.__version__} keras {keras.__version__}: fit ok, identical weights, native ops", flush=True)
hvd.shutdown()
