"""Writing a pack: ``pack`` reads image files (an image folder or a list file of 'path label'),
transcodes each JPEG losslessly to the tiled form on all cores, and writes the pack atomically
(format.py has the layout)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import threading
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastxfer import _core, _safefile
from fastxfer.data.decoders.native import libjpeg_path, native_decoder_status
from fastxfer.data.format import (DATA_OFFSET, FOOTER, FOOTER_MAGIC, HEADER, INDEX_DTYPE, MAGIC, MAX_CLASSES,
                                  MAX_SIDE, VERSION, PackedFormatError)
from fastxfer.errors import FastxferError
from fastxfer.log import logger


def _jpeg_header(data: bytes):
    """((height, width, colorspace), None) from a JPEG's header, or (None, why) when it has none."""
    import simplejpeg

    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as e:
        return None, str(e)
    return (h, w, colorspace), None


def scan_image_folder(src: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, label) pairs from SRC/<class>/<entry>, classes in sorted order. Every entry of a class
    folder is listed, whatever it is: `pack` reads only regular files (symbolic links followed) and
    skips and counts the rest, with the reason (a FIFO, a dangling or looping link, a sub-folder,
    which is not searched). Entries directly under SRC that are not folders belong to no class."""
    classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    if not classes:
        raise FastxferError(f"{src} has no class sub-folders (expected SRC/<class>/<image files>)")
    items = []
    for label, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(src, c))):
            items.append((os.path.join(src, c, f), label))
    return items, classes


_INT_LABEL = re.compile(r"[+-]?[0-9]+")


def read_list_file(path: str) -> tuple[list[tuple[str, int]], list[str]]:
    """Lines 'path label' ('#' starts a comment line); relative paths are relative to the file.

    Labels are either all non-negative integers (the class numbers; no names) or all class names
    (numbered 0, 1, ... in order of first appearance): one numbering per file. A negative or
    too large number, or a file that mixes numbers and names, is a FastxferError naming the file
    and line."""
    base = os.path.dirname(os.path.abspath(path))
    items, names = [], {}
    first = None  # (line, label, is a number) of the first label: it decides numbers or names
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.rsplit(None, 1)
            if len(parts) != 2:
                raise FastxferError(f"{path}:{lineno}: expected 'path label', got {line!r}")
            p, lab = parts
            numeric = _INT_LABEL.fullmatch(lab) is not None
            if first is None:
                first = (lineno, lab, numeric)
            elif numeric != first[2]:
                kinds = ("a class number", "a class name")
                raise FastxferError(
                    f"{path}:{lineno}: label {lab!r} is {kinds[not numeric]} but line {first[0]} gave "
                    f"{kinds[not first[2]]} ({first[1]!r}): a list file uses class numbers or class names, not both")
            if numeric:
                label = int(lab)
                if not 0 <= label < MAX_CLASSES:
                    raise FastxferError(f"{path}:{lineno}: label {lab} is not a class number "
                                        f"(0..{MAX_CLASSES - 1})")
            else:
                label = names.setdefault(lab, len(names))
                if label >= MAX_CLASSES:
                    raise FastxferError(f"{path}:{lineno}: more than {MAX_CLASSES} class names")
            items.append((p if os.path.isabs(p) else os.path.join(base, p), label))
    classes = [n for n, _ in sorted(names.items(), key=lambda kv: kv[1])] if names else []
    return items, classes


def _check_labels(items: list[tuple[str, int]], classes: list[str]) -> int:
    """The number of classes `items` ((path, label) pairs) span: len(classes) when named, else the
    largest label + 1. A label that is not an integer in 0..that-1 is a FastxferError naming it."""
    limit = len(classes) if classes else MAX_CLASSES
    top = -1
    for k, (path, label) in enumerate(items):
        if isinstance(label, (bool, np.bool_)) or not isinstance(label, (int, np.integer)) or not 0 <= label < limit:
            named = f"one of the {len(classes)} named classes" if classes else "an integer"
            raise FastxferError(f"item {k} ({path}): label {label!r} is not {named} in 0..{limit - 1}")
        top = max(top, int(label))
    return len(classes) if classes else top + 1


class _Tiler:
    """Lossless transcode of JPEGs to the tiled form (a restart marker after every MCU, see
    csrc/data/jpeg_tiles.h) with the native decoder's libjpeg-turbo; one per packing thread."""

    def __init__(self):
        ok, why = native_decoder_status()
        if not ok:
            raise PackedFormatError(f"cannot tile JPEGs here: {why} (pack with tiles=False / --no-tiles)")
        self._local = threading.local()
        self._path = libjpeg_path()

    def __call__(self, data: bytes) -> tuple[bytes, str | None]:
        dec = getattr(self._local, "dec", None)
        if dec is None:
            dec = self._local.dec = _core.JpegBatchDecoder(self._path, 1)
        try:
            return dec.transcode(data), None
        except RuntimeError as e:  # kept as it is: the loader decides at read time
            return data, str(e)


def _read(path: str):
    """(bytes, None), or (None, why) when the path is not a regular file (symbolic links followed)
    or cannot be read: packing skips it. Opened without blocking, so a FIFO is named, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "symbolic link loop"
        if e.errno == errno.ENOENT and os.path.islink(path):
            try:
                return None, f"dangling symbolic link (to {os.readlink(path)!r})"
            except OSError:
                pass
        return None, e.strerror or str(e)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder (sub-folders are not searched)",
                    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                    stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a regular file")
            return None, f"not a regular file: {kind}"
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as g:
            fd = -1
            return g.read(), None
    except OSError as e:
        return None, e.strerror or str(e)
    finally:
        if fd >= 0:
            os.close(fd)


def _nothing_packed(items: list, skipped: list[tuple[str, str]], out: str) -> str:
    """The error for a pack that would hold no record: what the files were, and what to do."""
    if not items:
        return f"nothing to pack into {out}: no files were given"
    exts = sorted({os.path.splitext(p)[1].lower() or "(no extension)" for p, _ in items})
    first = "; ".join(f"{p}: {why}" for p, why in skipped[:3])
    return (f"none of the {len(items)} file(s) is a JPEG that can be packed ({', '.join(exts[:8])}; {first}), so "
            f"nothing was written to {out}. fastxfer packs JPEG files only: convert the others first (for example "
            f"with Pillow: Image.open(src).convert('RGB').save(dst, 'JPEG', quality=95)) and pack the JPEGs")


def pack(items: Iterable[tuple[str, int]], out: str, classes: list[str] | None = None, progress: bool = True,
         source: str = "", tiles: bool | None = None, threads: int | None = None) -> dict:
    """Write `items` ((path, label) pairs) into `out` atomically. Labels must be integers in
    0..len(classes)-1 (any non-negative integer when `classes` is empty): anything else is a
    FastxferError before anything is written. Paths that are not regular files (FIFOs, devices,
    folders, dangling or looping symbolic links), unreadable files and non-JPEG files are skipped
    and counted: the summary's ``skipped`` lists (path, reason) for each, the metadata keeps the
    count. With `tiles` (the default when the native decoder can run here; None
    means: tile if possible, else warn and store as is) every JPEG is transcoded losslessly (the same
    DCT coefficients, so the same pixels) to a baseline JPEG with optimised Huffman tables and a
    restart marker after every MCU, which lets the loader entropy-decode only a crop's MCUs; files
    that cannot be transcoded (damaged data) are stored as they are. Metadata segments (EXIF, ICC)
    are not kept. Files are read and transcoded on `threads` threads (default: all usable CPUs).
    Returns a summary dict: records, skipped, untiled, bytes, seconds, classes (named), num_classes,
    tiles."""
    items = list(items)
    num_classes = _check_labels(items, classes or [])
    if tiles is None:
        ok, why = native_decoder_status()
        if not ok:
            logger.warning("fastxfer.data.pack: storing JPEGs untiled: the native decoder is unavailable (%s)", why)
        tiles = ok
    tiler = _Tiler() if tiles else None
    threads = max(1, threads or len(os.sched_getaffinity(0)))
    untiled: list[tuple[str, str]] = []

    def load(item):
        path, label = item
        data, why = _read(path)
        if data is None:
            return path, label, None, why, None
        hdr, why = _jpeg_header(data)
        if hdr is None:
            return path, label, None, f"not a readable JPEG ({why})", None
        if hdr[0] > MAX_SIDE or hdr[1] > MAX_SIDE:
            return path, label, None, f"too large ({hdr[1]}x{hdr[0]})", None
        note = None
        if tiler is not None:
            data, note = tiler(data)
        return path, label, data, hdr, note

    skipped: list[tuple[str, str]] = []
    index = np.zeros(len(items), INDEX_DTYPE)
    t0 = time.monotonic()
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(items), unit="img", desc=f"packing {os.path.basename(out)}", file=sys.stderr)
        except ImportError:
            bar = None
    n = 0
    try:
        # a fresh temporary file beside `out`, renamed over it when complete (fastxfer/_safefile.py:
        # never through a link planted at `out`, never another user's file)
        with _safefile.atomic(out) as f:
            f.write(HEADER.pack(MAGIC, VERSION, 0, DATA_OFFSET, 0))
            f.write(b"\0" * (DATA_OFFSET - HEADER.size))
            offset = DATA_OFFSET
            window = 8 * threads  # files in flight: bounded memory, in order
            with ThreadPoolExecutor(threads, thread_name_prefix="fastxfer-pack") as pool:
                for start in range(0, len(items), window):
                    for path, label, data, hdr, note in pool.map(load, items[start:start + window]):
                        if data is None:
                            skipped.append((path, hdr))
                        else:
                            if note is not None:
                                untiled.append((path, note))
                            f.write(data)
                            index[n] = (offset, len(data), zlib.crc32(data), label, hdr[0], hdr[1])
                            offset += len(data)
                            n += 1
                        if bar is not None:
                            bar.update(1)
            if n == 0:  # inside the atomic block: the temporary file goes, nothing replaces `out`
                raise FastxferError(_nothing_packed(items, skipped, out))
            index = index[:n]
            index_offset = offset
            raw = index.tobytes()
            f.write(raw)
            meta = json.dumps({"classes": classes or [], "num_classes": num_classes, "source": source,
                               "skipped": len(skipped), "tiles": bool(tiles), "untiled": len(untiled),
                               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()
            meta_offset = index_offset + len(raw)
            f.write(meta)
            f.write(FOOTER.pack(FOOTER_MAGIC, n, index_offset, meta_offset, len(meta), zlib.crc32(raw),
                                zlib.crc32(meta)))
    finally:
        if bar is not None:
            bar.close()
    return {"records": n, "skipped": skipped, "bytes": os.path.getsize(out), "seconds": time.monotonic() - t0,
            "classes": len(classes or []), "num_classes": num_classes, "tiles": bool(tiles), "untiled": untiled}
