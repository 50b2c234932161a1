"""``fastxfer bench pipeline``: images/s of the training and evaluation input pipelines, per core,
side by side with the equivalent tf.data pipeline (decode_and_crop_jpeg with
sample_distorted_bounding_box, resize, flip, normalise; one thread), a PIL + numpy pipeline, and
libjpeg-turbo decoding alone (the limit).

The JPEG sets are made from real photographs shipped inside installed packages (scikit-image's
sample data: astronaut, coffee, chelsea, rocket, Hubble deep field, immunohistochemistry, retina,
stereo motorcycle): random 4:3 crops resized to about 500x375 and 1000x750 and re-encoded at
quality 90. Photos smaller than 1000x750 are scaled up for that set.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from fastxfer.bench._common import machine_info, print_markdown, print_table, print_targets, status, usable_cpus

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "stereo_motorcycle"]


def make_set(n: int, size: tuple[int, int], seed: int = 0) -> list[bytes]:
    import simplejpeg
    import skimage.data
    from skimage.transform import resize

    rng = np.random.default_rng(seed)
    photos = []
    for name in PHOTOS:
        img = getattr(skimage.data, name)()
        img = img[0] if isinstance(img, tuple) else img
        photos.append(np.ascontiguousarray(img[..., :3]))
    out = []
    h_out, w_out = size
    for i in range(n):
        p = photos[i % len(photos)]
        ph, pw = p.shape[:2]
        ch = int(min(ph, pw * 3 / 4) * rng.uniform(0.6, 1.0))
        cw = int(ch * 4 / 3)
        y, x = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
        crop = resize(p[y:y + ch, x:x + cw], (h_out, w_out), anti_aliasing=True, preserve_range=True)
        out.append(simplejpeg.encode_jpeg(np.ascontiguousarray(crop.astype(np.uint8)), quality=90))
    return out


def _timed(fn, n_images: int, reps: int) -> float:
    fn()  # warm-up (JIT, caches)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n_images / statistics.median(times)


def _pil_pipeline(jpegs, train: bool):
    from PIL import Image

    from fastxfer.data import kernels as K

    mean = K.IMAGENET_MEAN * 255
    std = K.IMAGENET_STD * 255

    def run():
        for i, data in enumerate(jpegs):
            img = Image.open(io.BytesIO(data)).convert("RGB")
            w, h = img.size
            rng = K.image_rng(0, 0, 0, i)
            y, x, ch, cw = K.sample_rrc(rng, h, w) if train else K.center_crop_box(h, w)
            img = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
            if train and rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            _ = (np.asarray(img, np.float32) - mean) / std
    return run


_TF_CHILD = r"""
import json, os, sys, time, statistics
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
path, reps, train = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
jpegs = json.load(open(path))["files"]
data = [open(f, "rb").read() for f in jpegs]
mean = tf.constant([0.485, 0.456, 0.406]) * 255
std = tf.constant([0.229, 0.224, 0.225]) * 255
def train_map(b):
    shape = tf.io.extract_jpeg_shape(b)
    begin, size, _ = tf.image.sample_distorted_bounding_box(shape, tf.zeros([0, 0, 4]), min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    img = tf.io.decode_and_crop_jpeg(b, window, channels=3)
    img = tf.image.resize(img, (224, 224), method="bilinear")
    img = tf.image.random_flip_left_right(img)
    return (img - mean) / std
def eval_map(b):
    img = tf.io.decode_jpeg(b, channels=3)
    s = tf.shape(img)
    side = tf.cast(tf.cast(tf.minimum(s[0], s[1]), tf.float32) * 0.875, tf.int32)
    img = tf.image.crop_to_bounding_box(img, (s[0] - side) // 2, (s[1] - side) // 2, side, side)
    img = tf.image.resize(img, (224, 224), method="bilinear")
    return (img - mean) / std
ds = tf.data.Dataset.from_tensor_slices(data).map(train_map if train else eval_map, num_parallel_calls=1).batch(32)
opts = tf.data.Options(); opts.threading.private_threadpool_size = 1; opts.autotune.enabled = False
ds = ds.with_options(opts)
def run():
    for _ in ds: pass
run()
ts = []
for _ in range(reps):
    t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
print("FASTXFER_JSON " + json.dumps({"rate": len(data) / statistics.median(ts), "version": tf.__version__}))
"""


def _tf_rate(files: list[str], reps: int, train: bool, tmp: str):
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return None
    listing = os.path.join(tmp, "files.json")
    with open(listing, "w") as f:
        json.dump({"files": files}, f)
    r = subprocess.run([sys.executable, "-c", _TF_CHILD, listing, str(reps), "1" if train else "0"],
                       capture_output=True, text=True, timeout=1800, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    for line in r.stdout.splitlines():
        if line.startswith("FASTXFER_JSON "):
            return json.loads(line[len("FASTXFER_JSON "):])
    status(f"tf.data failed: {r.stderr.strip().splitlines()[-1:]}")
    return None


def run(n: int, reps: int, batch: int, tf_peer: bool = True) -> dict:
    import simplejpeg

    from fastxfer.data import Loader, pack

    rows = []
    cpus = usable_cpus()
    with tempfile.TemporaryDirectory(prefix="fastxfer-pipe-") as tmp:
        for label, size in (("500x375", (375, 500)), ("1000x750", (750, 1000))):
            status(f"building {n} JPEGs of {label} from scikit-image's photographs")
            jpegs = make_set(n, size)
            files = []
            for i, data in enumerate(jpegs):
                p = os.path.join(tmp, f"{label}-{i}.jpg")
                with open(p, "wb") as f:
                    f.write(data)
                files.append(p)
            packed = os.path.join(tmp, f"{label}.fxpack")
            pack([(f, i % 8) for i, f in enumerate(files)], packed, progress=False)
            status(f"{label}: measuring")

            def add(pipe, mode, threads, rate, version=""):
                rows.append({"set": label, "pipeline": pipe, "mode": mode, "threads": threads, "images_s": rate,
                             "per_core": rate / threads, "version": version})

            add("libjpeg-turbo decode alone (simplejpeg)", "decode", 1,
                _timed(lambda: [simplejpeg.decode_jpeg(d) for d in jpegs], n, reps))
            for train in (True, False):
                mode = "train" if train else "eval"
                for t in sorted({1, cpus}):
                    ld = Loader(packed, batch, image_size=224, train=train, threads=t, rank=0, size=1, prefetch=2)

                    def go(ld=ld):
                        for _ in ld:
                            pass
                    add("fastxfer Loader", mode, t, _timed(go, len(ld) * batch, reps))
                    ld.close()
                tf_res = _tf_rate(files, reps, train, tmp) if tf_peer else None
                if tf_res:
                    add("tf.data (decode_and_crop, resize, flip, normalise)", mode, 1, tf_res["rate"], tf_res["version"])
                try:
                    add("PIL + numpy", mode, 1, _timed(_pil_pipeline(jpegs, train), n, reps))
                except ImportError:
                    pass
    return {"machine": machine_info(), "images": n, "rows": rows, "targets": _targets(rows)}


def _rate(rows, s, pipe_prefix, mode, threads=1):
    for r in rows:
        if r["set"] == s and r["pipeline"].startswith(pipe_prefix) and r["mode"] == mode and r["threads"] == threads:
            return r["images_s"]
    return None


def _targets(rows) -> list[dict]:
    out = []
    fx5, tf5, dec5 = (_rate(rows, "500x375", "fastxfer", "train"), _rate(rows, "500x375", "tf.data", "train"),
                      _rate(rows, "500x375", "libjpeg", "decode"))
    fx10, tf10 = _rate(rows, "1000x750", "fastxfer", "train"), _rate(rows, "1000x750", "tf.data", "train")
    if fx5 and tf5:
        out.append({"target": "train, 500x375: >= 2x tf.data per core", "value": fx5 / tf5, "need": 2.0,
                    "ok": fx5 / tf5 >= 2.0})
    if fx5 and dec5:
        out.append({"target": "train, 500x375: >= 70% of decode alone", "value": fx5 / dec5, "need": 0.7,
                    "ok": fx5 / dec5 >= 0.7})
    if fx10 and tf10:
        out.append({"target": "train, 1000x750: >= 3x tf.data per core", "value": fx10 / tf10, "need": 3.0,
                    "ok": fx10 / tf10 >= 3.0})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=256, help="images per set (default 256)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--no-tf", action="store_true", help="skip the tf.data peer")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", action="store_true")


def main(args: argparse.Namespace) -> int:
    res = run(args.images, args.reps, args.batch, tf_peer=not args.no_tf)
    cols = ["set", "pipeline", "mode", "threads", "images/s", "images/s per core"]
    rows = [[r["set"], r["pipeline"], r["mode"], str(r["threads"]), f"{r['images_s']:.0f}", f"{r['per_core']:.0f}"]
            for r in res["rows"]]
    m = res["machine"]
    caption = f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | {res['images']} images per set | medians"
    print_table("fastxfer bench pipeline", cols, rows, caption)
    print_targets(res["targets"])
    if args.markdown:
        print_markdown(m, caption, cols, rows, res["targets"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.pipeline", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
