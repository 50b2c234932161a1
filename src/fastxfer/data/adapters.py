"""Framework adapters over a Loader: a ``keras.utils.PyDataset`` and a ``tf.data.Dataset``.
Keras and TensorFlow are imported only when an adapter is asked for."""

from __future__ import annotations


def as_keras(loader):
    """A keras.utils.PyDataset over `loader` (reshuffles at each epoch end)."""
    import keras

    class _Data(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=1, use_multiprocessing=False)

        def __len__(self):
            return len(loader)

        def __getitem__(self, i):
            return loader.batch(i)

        def on_epoch_end(self):
            loader.set_epoch(loader.epoch + 1)

    return _Data()


def as_tf_dataset(loader):
    """A tf.data.Dataset yielding `loader`'s batches (prefetched by the loader itself)."""
    import tensorflow as tf

    s = loader.image_size
    img_dtype = tf.bfloat16 if loader.dtype == "bfloat16" else tf.float32
    soft = loader.mixup_alpha > 0 or loader.label_smoothing > 0
    label_spec = (tf.TensorSpec((None, loader.num_classes), tf.float32) if soft else tf.TensorSpec((None,), tf.int32))

    def gen():
        for images, targets in loader:
            yield images, targets

    return tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec((None, s, s, 3), img_dtype), label_spec))
