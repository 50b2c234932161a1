"""Horovod 0.28.1's examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py, shortened for the
tests, with `import horovod.tensorflow.keras as hvd` replaced by fastxfer's import. Every Horovod
call is the example's: a keras.applications model, DistributedOptimizer with optional fp16
compression, compile(..., experimental_run_tf_function=False), BroadcastGlobalVariables- and
MetricAverageCallback, throughput printed by rank 0.

Shortened: the defaults are MobileNetV3Small on 32x32 images with 10 classes, batches of 8, 3
iterations of 2 batches (Horovod's: ResNet50 on 224x224 with 1000 classes, 32, 10 x 10). The last
block (marked) is test instrumentation.
"""

import argparse
import os
from timeit import default_timer as timer

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import fastxfer.keras as hvd  # was: import horovod.tensorflow.keras as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='TensorFlow Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--model', type=str, default='MobileNetV3Small', help='model to benchmark')
parser.add_argument('--image-size', type=int, default=32, help='image height and width')
parser.add_argument('--num-classes', type=int, default=10, help='number of classes')
parser.add_argument('--batch-size', type=int, default=8, help='input batch size')
parser.add_argument('--num-batches-per-iter', type=int, default=2, help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=3, help='number of benchmark iterations')
parser.add_argument('--no-cuda', action='store_true', default=False, help='disables CUDA training')

args = parser.parse_args()
args.cuda = not args.no_cuda
device = 'GPU' if args.cuda else 'CPU'

# Horovod: initialize Horovod.
hvd.init()

if hvd.rank() == 0:
    print('Model: %s' % args.model)
    print('Batch size: %d' % args.batch_size)
    print('Number of %ss: %d' % (device, hvd.size()))

# Horovod: pin GPU to be used to process local rank (one GPU per process)
if args.cuda:
    device_type = 'XPU' if hvd.sycl_built() else 'GPU'
    gpus = tf.config.experimental.list_physical_devices(device_type)
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], device_type)
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# Set up standard model.
shape = (args.image_size, args.image_size, 3)
model = getattr(applications, args.model)(weights=None, input_shape=shape, classes=args.num_classes)
opt = tf.optimizers.SGD(0.01)

# Synthetic dataset
data = tf.random.uniform([args.batch_size, *shape])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=args.num_classes - 1, dtype=tf.int64)
dataset = tf.data.Dataset.from_tensor_slices((data, target)).cache().repeat().batch(args.batch_size)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, compression=compression)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
]


class TimingCallback(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.img_secs = []

    def on_train_end(self, logs=None):
        img_sec_mean = np.mean(self.img_secs)
        img_sec_conf = 1.96 * np.std(self.img_secs)
        print('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
        print('Total img/sec on %d %s(s): %.1f +-%.1f' %
              (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

    def on_epoch_begin(self, epoch, logs=None):
        self.starttime = timer()

    def on_epoch_end(self, epoch, logs=None):
        time = timer() - self.starttime
        img_sec = args.batch_size * args.num_batches_per_iter / time
        print('Iter #%d: %.1f img/sec per %s' % (epoch, img_sec, device))
        # skip warm up epoch
        if epoch > 0:
            self.img_secs.append(img_sec)


# Horovod: write logs on worker 0.
if hvd.rank() == 0:
    timing = TimingCallback()
    callbacks.append(timing)

# Train the model.
model.fit(dataset, batch_size=args.batch_size, steps_per_epoch=args.num_batches_per_iter, callbacks=callbacks,
          epochs=args.num_iters, verbose=0)

# -- test instrumentation (not in Horovod's example) --
# trainable weights: batch normalization's moving statistics are each rank's own, as in Horovod
digest = float(sum(np.float64(np.sum(np.abs(w.numpy()))) for w in model.trainable_weights))
print(f"FINAL rank {hvd.rank()} weights {digest!r}", flush=True)
