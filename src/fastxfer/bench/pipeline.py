"""``fastxfer bench pipeline``: images/s of the training and evaluation input pipelines, per core,
side by side with the equivalent tf.data pipeline (decode_and_crop_jpeg with
sample_distorted_bounding_box, resize, flip, normalise; one thread), a PIL + numpy pipeline, and
libjpeg-turbo decoding alone (the limit); the Loader with its native decoder (threads from 1 to all
cores) and with the simplejpeg + Numba reference path. Every row also reports the CPU it used
(process CPU time / wall time), so "per core" can be checked. A second table times the resampling
step alone (crop + resize + flip + normalise of a decoded image): the C++ kernel, the Numba kernel,
and PIL's resize + numpy.

The JPEG sets are made from real photographs shipped inside installed packages (scikit-image's
sample data: astronaut, coffee, chelsea, rocket, Hubble deep field, immunohistochemistry, retina,
stereo motorcycle): random 4:3 crops resized to about 500x375 and 1000x750 and re-encoded at
quality 90. Photos smaller than 1000x750 are scaled up for that set.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from fastxfer.bench.harness import (machine_info, markdown_table, print_markdown, print_table, print_targets, pyplot,
                                    save_plot, status, target, timed_call, usable_cpus, worker_command, write_json)

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


def _timed(fn, n_images: int, reps: int) -> tuple[float, float]:
    """(images/s, CPU cores busy) of fn, median over reps after a warm-up."""
    fn()  # warm-up (JIT, caches, first-read checksums)
    times, cpus = zip(*(timed_call(fn) for _ in range(reps)))
    return n_images / statistics.median(times), statistics.median(cpus)


def _params(heights, widths, train: bool):
    from fastxfer.data import sampling as K

    u = K.image_uniforms(0, 0, 0, np.arange(len(heights)))
    return K.augment_params(u, np.asarray(heights), np.asarray(widths), train)


def _pil_pipeline(jpegs, train: bool):
    from PIL import Image

    from fastxfer.data.decoders import numba_ref as K

    mean = K.IMAGENET_MEAN * 255
    std = K.IMAGENET_STD * 255
    sizes = [Image.open(io.BytesIO(d)).size for d in jpegs]
    boxes, flips, _ = _params([h for _, h in sizes], [w for w, _ in sizes], train)

    def run():
        for i, data in enumerate(jpegs):
            img = Image.open(io.BytesIO(data)).convert("RGB")
            y, x, ch, cw = (int(v) for v in boxes[i])
            img = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
            if flips[i]:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            _ = (np.asarray(img, np.float32) - mean) / std
    return run


def _kernel_rows(jpegs, reps: int) -> list[dict]:
    """The resampling step alone on decoded images: C++ vs Numba vs PIL (+ numpy normalise)."""
    import simplejpeg
    from PIL import Image

    from fastxfer import _core  # the C++ resampler itself: it has no Python wrapper to time instead
    from fastxfer.data.decoders import numba_ref as K

    imgs = [simplejpeg.decode_jpeg(d) for d in jpegs[:32]]
    boxes, flips, _ = _params([im.shape[0] for im in imgs], [im.shape[1] for im in imgs], True)
    out = np.empty((224, 224, 3), np.float32)
    scratch = np.empty(K.scratch_size(1024, 224), np.float32)
    mean, std = K.IMAGENET_MEAN, K.IMAGENET_STD
    pil_imgs = [Image.fromarray(im) for im in imgs]

    def native():
        for im, b, f in zip(imgs, boxes, flips):
            _core.resize_normalize(im, *(int(v) for v in b), out, bool(f), 1.0, 1.0, 1.0, mean, std)

    def numba():
        for im, b, f in zip(imgs, boxes, flips):
            K.crop_resize_normalize_scratch(im, *(int(v) for v in b), out, bool(f), 1.0, 1.0, 1.0, mean, std,
                                            scratch)

    def pil():
        for im, (y, x, ch, cw), f in zip(pil_imgs, boxes, flips):
            r = im.resize((224, 224), Image.BILINEAR, box=(int(x), int(y), int(x + cw), int(y + ch)))
            if f:
                r = r.transpose(Image.FLIP_LEFT_RIGHT)
            _ = (np.asarray(r, np.float32) - mean * 255) / (std * 255)

    rows = []
    for name, fn in (("fastxfer C++ resampler", native), ("fastxfer Numba kernel", numba),
                     ("PIL resize (BILINEAR, box) + numpy normalise", pil)):
        rate, _ = _timed(fn, len(imgs), max(reps, 5))
        rows.append({"kernel": name, "us_per_image": 1e6 / rate})
    base = rows[0]["us_per_image"]
    for r in rows:
        r["vs_cpp"] = r["us_per_image"] / base
    return rows


class _Peer:
    """One contender of an interleaved measurement: rep() runs one timed pass over the set."""

    def __init__(self, name, mode, threads, images, fn=None, version=""):
        self.name, self.mode, self.threads, self.images, self.fn, self.version = name, mode, threads, images, fn, version
        self.times, self.cpus = [], []

    def rep(self, record=True):
        dt, busy = timed_call(self.fn)
        if record:
            self.times.append(dt)
            self.cpus.append(busy)

    def close(self):
        pass


class _TfPeer(_Peer):
    """tf.data in a child process (its own threads settings), one pass per request on stdin."""

    def __init__(self, files, train, tmp):
        listing = os.path.join(tmp, "files.json")
        with open(listing, "w") as f:
            json.dump({"files": files}, f)
        cmd = worker_command("pipeline_worker", "--files", listing, *(["--train"] if train else []))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        version = ""
        for line in self.proc.stdout:
            if line.startswith("READY "):
                version = line.split()[1]
                break
        else:
            err = self.proc.stderr.read().strip().splitlines()[-1:] if self.proc.stderr else []
            raise RuntimeError(f"tf.data peer failed: {err}")
        super().__init__("tf.data (decode_and_crop, resize, flip, normalise)", "train" if train else "eval", 1,
                         len(files), version=version)

    def rep(self, record=True):
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        if record:
            self.times.append(r["seconds"])
            self.cpus.append(r["cpu_seconds"] / r["seconds"])

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _measure(peers: list[_Peer], reps: int) -> None:
    """Warm every peer up, then time them round-robin: each round runs every peer once, so slow
    and fast periods of a shared machine fall on all of them alike."""
    for p in peers:
        p.rep(record=False)
    for _ in range(reps):
        for p in peers:
            p.rep()


def run(n: int, reps: int, batch: int, tf_peer: bool = True) -> dict:
    import simplejpeg

    from fastxfer.data import Loader, pack
    from fastxfer.data.decoders.native import native_decoder_status

    rows = []
    cpus = usable_cpus()
    native_ok, native_note = native_decoder_status()
    if not native_ok:
        status(f"native decoder unavailable ({native_note}): only the Numba path runs")
    kernels = []
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

            def add(pipe, mode, threads, timing, version=""):
                rate, busy = timing
                rows.append({"set": label, "pipeline": pipe, "mode": mode, "threads": threads, "images_s": rate,
                             "per_core": rate / threads, "cpu": busy, "version": version})

            peers = [_Peer("libjpeg-turbo decode alone (simplejpeg)", "decode", 1, n,
                           lambda: [simplejpeg.decode_jpeg(d) for d in jpegs])]
            loaders = []
            for train in (True, False):
                mode = "train" if train else "eval"
                configs = [("fastxfer Loader", "native", t) for t in sorted({1, cpus}) if native_ok]
                configs.append(("fastxfer Loader, simplejpeg + Numba", "numba", 1))
                if train and native_ok:  # the decoder's own share: the same crops, decoded, not resampled
                    configs.append(("fastxfer decode of the crops alone (no resampling)", "decode-only", 1))
                for name, decoder, t in configs:
                    ld = Loader(packed, batch, image_size=224, train=train, threads=t, rank=0, size=1, prefetch=2,
                                decoder="native" if decoder == "decode-only" else decoder)
                    if decoder == "decode-only":
                        ld.native_decoder.set_decode_only(True)
                    loaders.append(ld)

                    def go(ld=ld):
                        for _ in ld:
                            pass
                    peers.append(_Peer(name, "decode" if decoder == "decode-only" else mode, t, len(ld) * batch, go))
                if tf_peer and importlib.util.find_spec("tensorflow") is not None:
                    try:
                        peers.append(_TfPeer(files, train, tmp))
                    except RuntimeError as e:
                        status(str(e))
                try:
                    peers.append(_Peer("PIL + numpy", mode, 1, n, _pil_pipeline(jpegs, train)))
                except ImportError:
                    pass
            try:
                _measure(peers, reps)
            finally:
                for p in peers:
                    p.close()
                for ld in loaders:
                    ld.close()
            for p in peers:
                dt = statistics.median(p.times)
                add(p.name, p.mode, p.threads, (p.images / dt, statistics.median(p.cpus)), p.version)
            if label == "500x375" and native_ok:
                status("resampling kernels alone")
                kernels = _kernel_rows(jpegs, reps)
    return {"machine": machine_info(), "images": n, "rows": rows, "kernels": kernels, "targets": _targets(rows),
            "native_decoder": native_note}


def _rate(rows, s, pipe, mode, threads=1):
    for r in rows:
        if r["set"] == s and r["pipeline"].startswith(pipe) and r["mode"] == mode and r["threads"] == threads:
            return r["images_s"]
    return None


def _targets(rows) -> list[dict]:
    out = []
    fx = "fastxfer Loader"  # the native decoder's rows (the Numba rows say so in their name)
    fx5 = next((r["images_s"] for r in rows if r["set"] == "500x375" and r["pipeline"] == fx and r["mode"] == "train"
                and r["threads"] == 1), None)
    fx10 = next((r["images_s"] for r in rows if r["set"] == "1000x750" and r["pipeline"] == fx
                 and r["mode"] == "train" and r["threads"] == 1), None)
    tf5, dec5 = _rate(rows, "500x375", "tf.data", "train"), _rate(rows, "500x375", "libjpeg", "decode")
    tf10 = _rate(rows, "1000x750", "tf.data", "train")
    if fx5 and tf5:
        out.append(target("train, 500x375: >= 2x tf.data per core", fx5 / tf5, 2.0, fx5 / tf5 >= 2.0))
    if fx5 and dec5:
        out.append(target("train, 500x375: >= 70% of decode alone", fx5 / dec5, 0.7, fx5 / dec5 >= 0.7))
    if fx10 and tf10:
        out.append(target("train, 1000x750: >= 3x tf.data per core", fx10 / tf10, 3.0, fx10 / tf10 >= 3.0))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=256, help="images per set (default 256)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--no-tf", action="store_true", help="skip the tf.data peer")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="plot images/s per pipeline and the Loader's scaling with threads")


def main(args: argparse.Namespace) -> int:
    res = run(args.images, args.reps, args.batch, tf_peer=not args.no_tf)
    cols = ["set", "pipeline", "mode", "threads", "images/s", "images/s per core", "CPU busy"]
    rows = [[r["set"], r["pipeline"], r["mode"], str(r["threads"]), f"{r['images_s']:.0f}", f"{r['per_core']:.0f}",
             f"{r['cpu']:.2f}"] for r in res["rows"]]
    m = res["machine"]
    caption = f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | {res['images']} images per set | medians"
    print_table("fastxfer bench pipeline", cols, rows, caption)
    kcols = ["resampling step (500x375 decoded -> 224x224 float32)", "us/image", "x C++ time"]
    krows = [[k["kernel"], f"{k['us_per_image']:.0f}", f"{k['vs_cpp']:.2f}"] for k in res["kernels"]]
    if krows:
        print_table("resampling kernels alone", kcols, krows)
    print_targets(res["targets"])
    if args.markdown:
        print_markdown(m, caption, cols, rows, res["targets"])
        if krows:
            print()
            print(markdown_table(kcols, krows))
    if args.plot:
        _plot(res, args.plot)
    if args.json:
        write_json(args.json, res)
    return 0


def _plot(res: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sets = ["500x375", "1000x750"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, label in zip(axes, sets):
        rows = [r for r in res["rows"] if r["set"] == label and r["threads"] == 1]
        names = [f"{r['pipeline']}\n{r['mode']}" for r in rows]
        ax.barh(range(len(rows)), [r["images_s"] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("images/s on one core")
        ax.set_title(label)
    save_plot(fig, path, dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.pipeline", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
