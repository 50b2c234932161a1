"""Horovod-signature front ends of the newer collectives (fastxfer.tensorflow / fastxfer.keras):
alltoall and reducescatter with process_set=, join() with uneven batches. Prints 'OK ...'."""

import numpy as np
import tensorflow as tf

import fastxfer.keras as khvd
import fastxfer.tensorflow as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()

# alltoall with Horovod's signature: rank r sends j+1 rows of value 10*r+j to rank j
splits = [j + 1 for j in range(n)]
x = tf.constant(np.concatenate([np.full((j + 1, 2), 10 * r + j, np.float32) for j in range(n)]))
got, rsplits = hvd.alltoall(x, splits=splits, process_set=hvd.global_process_set)
want = np.concatenate([np.full((r + 1, 2), 10 * j + r, np.float32) for j in range(n)])
assert np.array_equal(got.numpy(), want), (got.numpy(), want)
assert rsplits.numpy().tolist() == [r + 1] * n
try:
    hvd.alltoall(x, splits=splits, process_set="not a process set")
    raise SystemExit("a process set other than the global one was accepted")
except TypeError as e:
    assert "process_set must be a ProcessSet" in str(e), e

# reducescatter through the Keras front end: Sum of rows; rank r keeps its share
rows = tf.constant(np.arange(5 * 3, dtype=np.float32).reshape(5, 3) * (r + 1))
part = khvd.reducescatter(rows, op=hvd.Sum).numpy()
full = np.arange(15, dtype=np.float32).reshape(5, 3) * sum(range(1, n + 1))
counts = [5 // n + (1 if j < 5 % n else 0) for j in range(n)]
lo = sum(counts[:r])
assert np.array_equal(part, full[lo:lo + counts[r]]), (part, full)

# join: rank j has j+1 batches; the others keep reducing with the joined ranks standing in
for i in range(r + 1):
    s = hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum, name=f"b{i}").numpy()
    assert s[0] == sum(j + 1 for j in range(n) if j >= i), (i, s)
last = hvd.join()
assert last.dtype == tf.int32 and int(last) == n - 1, last
print(f"OK hvd collectives rank {r}")
