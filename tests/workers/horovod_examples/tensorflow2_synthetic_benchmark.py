"""Horovod 0.28.1's examples/tensorflow2/tensorflow2_synthetic_benchmark.py, shortened for the tests,
with `import horovod.tensorflow as hvd` replaced by fastxfer's import. Every Horovod call is the
example's: a tf.function step with DistributedGradientTape (optional fp16 compression),
broadcast_variables of the model's and the optimizer's variables after the first step.

Shortened: the defaults are MobileNetV3Small on 32x32 images with 10 classes, batches of 8, 2
warm-up batches and 2 iterations of 2 batches (Horovod's: ResNet50 on 224x224 with 1000 classes,
32, 10 and 10 x 10). It calls ``opt.variables()``, which works on tf-keras optimizers
(TF_USE_LEGACY_KERAS=1) and not on Keras 3's. The last block (marked) is test instrumentation.
"""

import argparse
import os
import timeit

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import fastxfer.tensorflow as hvd  # was: import horovod.tensorflow as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='TensorFlow Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--model', type=str, default='MobileNetV3Small', help='model to benchmark')
parser.add_argument('--image-size', type=int, default=32, help='image height and width')
parser.add_argument('--num-classes', type=int, default=10, help='number of classes')
parser.add_argument('--batch-size', type=int, default=8, help='input batch size')
parser.add_argument('--num-warmup-batches', type=int, default=2,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=2, help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=2, help='number of benchmark iterations')
parser.add_argument('--no-cuda', action='store_true', default=False, help='disables CUDA training')

args = parser.parse_args()
args.cuda = not args.no_cuda

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
if args.cuda:
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# Set up standard model.
shape = (args.image_size, args.image_size, 3)
model = getattr(applications, args.model)(weights=None, input_shape=shape, classes=args.num_classes)
opt = tf.optimizers.SGD(0.01)

data = tf.random.uniform([args.batch_size, *shape])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=args.num_classes - 1, dtype=tf.int64)


@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes, after the
    # first gradient step so that the optimizer's variables exist.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

with tf.device(device):
    # Warm-up
    log('Running warmup...')
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

    # Benchmark
    log('Running benchmark...')
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
    log('Total img/sec on %d %s(s): %.1f +-%.1f' %
        (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

# -- test instrumentation (not in Horovod's example) --
# trainable weights: batch normalization's moving statistics are each rank's own, as in Horovod
digest = float(sum(np.float64(np.sum(np.abs(w.numpy()))) for w in model.trainable_variables))
print(f"FINAL rank {hvd.rank()} weights {digest!r}", flush=True)
