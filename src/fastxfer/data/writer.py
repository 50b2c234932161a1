"""The packed dataset format: one memory-mappable file holding every encoded image back to back,
an index (offset, size, CRC-32, label, height, width per record) and the class names.

Layout (little-endian)::

    [header 64 B][records ...][index: count x 24 B][metadata JSON][footer 64 B]

The footer is written last and repeats what the header cannot know in advance (index offset,
record count, index CRC); a file without a valid footer is incomplete. Packing writes to
``OUT.partial-<pid>`` and renames it over ``OUT`` only after flushing, so a crash never leaves a
file named OUT that looks valid. Every record carries a CRC-32: readers check it (``verify=True``)
and a mismatch raises CorruptRecordError naming the record.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterable

import numpy as np

from fastxfer.errors import FastxferError

MAGIC = b"FXPACK\x00\x01"
FOOTER_MAGIC = b"FXPKEND\x01"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ32x")   # magic, version, flags, data_offset, reserved(Q), pad -> 64 B
FOOTER = struct.Struct("<8sQQQQII16x")  # magic, record_count, index_offset, meta_offset, meta_bytes, index_crc, meta_crc
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("crc32", "<u4"), ("label", "<i4"),
                        ("height", "<u2"), ("width", "<u2")])
DATA_OFFSET = 4096


class PackedFormatError(FastxferError):
    """The file is not a complete fastxfer pack (wrong magic, truncated, bad index)."""


class CorruptRecordError(PackedFormatError):
    """A record's bytes do not match its checksum."""


def _jpeg_header(data: bytes):
    import simplejpeg

    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as e:
        return None, str(e)
    return (h, w, colorspace), None


def scan_image_folder(src: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, label) pairs from SRC/<class>/<file>, classes in sorted order."""
    classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    if not classes:
        raise FastxferError(f"{src} has no class sub-folders (expected SRC/<class>/<image files>)")
    items = []
    for label, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(src, c))):
            p = os.path.join(src, c, f)
            if os.path.isfile(p):
                items.append((p, label))
    return items, classes


def read_list_file(path: str) -> tuple[list[tuple[str, int]], list[str]]:
    """Lines 'path label' (label an integer or a class name); relative paths are relative to the file."""
    base = os.path.dirname(os.path.abspath(path))
    items, names = [], {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.rsplit(None, 1)
            if len(parts) != 2:
                raise FastxferError(f"{path}:{lineno}: expected 'path label', got {line!r}")
            p, lab = parts
            if lab.lstrip("-").isdigit():
                label = int(lab)
            else:
                label = names.setdefault(lab, len(names))
            items.append((p if os.path.isabs(p) else os.path.join(base, p), label))
    classes = [n for n, _ in sorted(names.items(), key=lambda kv: kv[1])] if names else []
    return items, classes


class _Tiler:
    """Lossless transcode of JPEGs to the tiled form (a restart marker after every MCU, see
    csrc/data/jpeg_tiles.h) with the native decoder's libjpeg-turbo; one per packing thread."""

    def __init__(self):
        from fastxfer import _core
        from fastxfer.data.loader import libjpeg_path, native_decoder_status

        ok, why = native_decoder_status()
        if not ok:
            raise PackedFormatError(f"cannot tile JPEGs here: {why} (pack with tiles=False / --no-tiles)")
        self._local = threading.local()
        self._path = libjpeg_path()
        self._core = _core

    def __call__(self, data: bytes) -> tuple[bytes, str | None]:
        dec = getattr(self._local, "dec", None)
        if dec is None:
            dec = self._local.dec = self._core.JpegBatchDecoder(self._path, 1)
        try:
            return dec.transcode(data), None
        except RuntimeError as e:  # kept as it is: the loader decides at read time
            return data, str(e)


def _read(path: str):
    try:
        with open(path, "rb") as g:
            return g.read(), None
    except OSError as e:
        return None, e.strerror or str(e)


def pack(items: Iterable[tuple[str, int]], out: str, classes: list[str] | None = None, progress: bool = True,
         source: str = "", tiles: bool | None = None, threads: int | None = None) -> dict:
    """Write `items` ((path, label) pairs) into `out` atomically. Non-JPEG or unreadable files are
    skipped and counted. With `tiles` (the default when the native decoder can run here; None
    means: tile if possible, else warn and store as is) every JPEG is transcoded losslessly (the same
    DCT coefficients, so the same pixels) to a baseline JPEG with optimised Huffman tables and a
    restart marker after every MCU, which lets the loader entropy-decode only a crop's MCUs; files
    that cannot be transcoded (damaged data) are stored as they are. Metadata segments (EXIF, ICC)
    are not kept. Files are read and transcoded on `threads` threads (default: all usable CPUs).
    Returns a summary dict."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    if tiles is None:
        from fastxfer.data.loader import native_decoder_status

        ok, why = native_decoder_status()
        if not ok:
            import warnings

            warnings.warn(f"fastxfer.data.pack: storing JPEGs untiled: the native decoder is unavailable ({why})",
                          RuntimeWarning, stacklevel=2)
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
        if hdr[0] > 65535 or hdr[1] > 65535:
            return path, label, None, f"too large ({hdr[1]}x{hdr[0]})", None
        note = None
        if tiler is not None:
            data, note = tiler(data)
        return path, label, data, hdr, note

    tmp = f"{out}.partial-{os.getpid()}"
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
        with open(tmp, "wb") as f:
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
            index = index[:n]
            index_offset = offset
            raw = index.tobytes()
            f.write(raw)
            meta = json.dumps({"classes": classes or [], "source": source, "skipped": len(skipped),
                               "tiles": bool(tiles), "untiled": len(untiled),
                               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()
            meta_offset = index_offset + len(raw)
            f.write(meta)
            f.write(FOOTER.pack(FOOTER_MAGIC, n, index_offset, meta_offset, len(meta), zlib.crc32(raw),
                                zlib.crc32(meta)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        if bar is not None:
            bar.close()
    return {"records": n, "skipped": skipped, "bytes": os.path.getsize(out), "seconds": time.monotonic() - t0,
            "classes": len(classes or []), "tiles": bool(tiles), "untiled": untiled}


class PackedDataset:
    """Read-only, memory-mapped view of a pack. ``len(ds)``, ``ds.labels``, ``ds.heights``,
    ``ds.widths``, ``ds.record(i)`` (a zero-copy memoryview of the encoded bytes; with verify=True
    its CRC is checked the first time this process reads it), ``ds.classes``."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self.verify = verify
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise PackedFormatError(f"{path}: cannot open: {e.strerror}") from None
        size = os.fstat(self._file.fileno()).st_size
        if size < DATA_OFFSET + FOOTER.size:
            self._file.close()
            raise PackedFormatError(f"{path}: {size} bytes is too short for a fastxfer pack (truncated or not a pack)")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._open(size)
        except BaseException:
            self.close()
            raise

    def _open(self, size: int) -> None:
        magic, version, _flags, data_offset, _ = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC:
            raise PackedFormatError(f"{self.path}: not a fastxfer pack (magic {magic!r})")
        if version != VERSION:
            raise PackedFormatError(f"{self.path}: format version {version}, this fastxfer reads {VERSION}")
        fmagic, count, index_offset, meta_offset, meta_bytes, index_crc, meta_crc = FOOTER.unpack_from(
            self._mm, size - FOOTER.size)
        if fmagic != FOOTER_MAGIC:
            raise PackedFormatError(f"{self.path}: incomplete or truncated (no end marker in the last "
                                    f"{FOOTER.size} bytes): re-run `fastxfer data pack`")
        if not (data_offset <= index_offset <= meta_offset and
                meta_offset + meta_bytes + FOOTER.size == size and
                index_offset + count * INDEX_DTYPE.itemsize == meta_offset):
            raise PackedFormatError(f"{self.path}: inconsistent layout (index at {index_offset}, {count} records, "
                                    f"metadata at {meta_offset}, file {size} bytes)")
        raw = self._mm[index_offset:meta_offset]
        if zlib.crc32(raw) != index_crc:
            raise PackedFormatError(f"{self.path}: the index is corrupted (checksum mismatch)")
        meta = self._mm[meta_offset:meta_offset + meta_bytes]
        if zlib.crc32(meta) != meta_crc:
            raise PackedFormatError(f"{self.path}: the metadata is corrupted (checksum mismatch)")
        self.index = np.frombuffer(raw, INDEX_DTYPE).copy()
        self._verified = bytearray(len(self.index))  # CRC checked once per record per process
        ends = self.index["offset"].astype(np.int64) + self.index["size"]
        bad = np.flatnonzero((self.index["offset"] < data_offset) | (ends > index_offset))
        if bad.size:
            raise PackedFormatError(f"{self.path}: record {int(bad[0])} points outside the data region")
        self.meta = json.loads(meta)
        self.classes = list(self.meta.get("classes", []))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def labels(self) -> np.ndarray:
        return self.index["label"]

    @property
    def heights(self) -> np.ndarray:
        return self.index["height"]

    @property
    def widths(self) -> np.ndarray:
        return self.index["width"]

    def record(self, i: int) -> memoryview:
        if not 0 <= i < len(self.index):
            raise IndexError(f"record {i} out of range 0..{len(self.index) - 1}")
        rec = self.index[i]
        off, n = int(rec["offset"]), int(rec["size"])
        return self.checked(i, memoryview(self._mm)[off:off + n])

    def checked(self, i: int, view: memoryview) -> memoryview:
        """`view` (record i's bytes, from the file or a copy of it), its CRC checked the first time
        (verify=True); CorruptRecordError names the record on a mismatch."""
        if self.verify and not self._verified[i]:
            rec = self.index[i]
            if zlib.crc32(view) != int(rec["crc32"]):
                raise CorruptRecordError(f"{self.path}: record {i} (label {int(rec['label'])}, {int(rec['size'])} "
                                         f"bytes at offset {int(rec['offset'])}) is corrupted: checksum mismatch")
            self._verified[i] = 1
        return view

    def verify_all(self) -> list[int]:
        """Indices of records whose checksum does not match."""
        return [i for i in range(len(self.index))
                if zlib.crc32(memoryview(self._mm)[int(self.index[i]["offset"]):int(self.index[i]["offset"])
                                                    + int(self.index[i]["size"])]) != int(self.index[i]["crc32"])]

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are still alive; the mapping goes when they do
        f, self._file = getattr(self, "_file", None), None
        if f is not None:
            f.close()

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
