"""Reading a pack: ``PackedDataset``, a read-only memory map of the file with its index and
metadata checked on open (every field against what the format allows: a forged index with valid
CRCs is refused there, naming the record and the field) and each record's CRC-32 checked the
first time this process reads it (format.py has the layout)."""

from __future__ import annotations

import json
import mmap
import os
import zlib

import numpy as np

from fastxfer.data.format import (DATA_OFFSET, FOOTER, FOOTER_MAGIC, HEADER, INDEX_DTYPE, MAGIC, MAX_CLASSES,
                                  VERSION, CorruptRecordError, PackedFormatError)


class PackedDataset:
    """Read-only, memory-mapped view of a pack. ``len(ds)``, ``ds.labels``, ``ds.heights``,
    ``ds.widths``, ``ds.record(i)`` (a zero-copy memoryview of the encoded bytes; with verify=True
    its CRC is checked the first time this process reads it), ``ds.classes``, ``ds.num_classes``
    (labels are 0..num_classes-1, checked on open)."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self.verify = verify
        self._blob = None  # the whole file in memory, once cache() has read it
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
        if not (HEADER.size <= data_offset <= index_offset <= meta_offset and
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
        self.meta = self._check_meta(meta)
        self.classes = self.meta["classes"]
        self._check_index(data_offset, index_offset)

    def _bad_record(self, i: int, field: str, why: str) -> PackedFormatError:
        rec = self.index[i]
        return PackedFormatError(f"{self.path}: index record {i}: {field} {int(rec[field])} {why} (a damaged or "
                                 f"forged index: re-run `fastxfer data pack`)")

    def _check_index(self, data_offset: int, index_offset: int) -> None:
        """Every index field against what the format allows; the first bad record is named."""
        idx = self.index
        off = idx["offset"]  # uint64: compared without ever converting to a signed type
        size = idx["size"].astype(np.uint64)
        end = np.uint64(index_offset)
        outside = (off < np.uint64(data_offset)) | (off > end) | (size > end - np.minimum(off, end))
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            if not data_offset <= int(idx["offset"][i]) <= index_offset:
                raise self._bad_record(i, "offset", f"is outside the data region {data_offset}..{index_offset}")
            raise self._bad_record(i, "size", f"at offset {int(idx['offset'][i])} runs past the data region's end "
                                              f"({index_offset})")
        for field in ("height", "width"):
            zero = np.flatnonzero(idx[field] == 0)
            if zero.size:
                raise self._bad_record(int(zero[0]), field, "is not a valid image size (must be 1..65535)")
        bad = np.flatnonzero((idx["label"] < 0) | (idx["label"] >= self.num_classes))
        if bad.size:
            named = f"the pack names {len(self.classes)} classes" if self.classes else \
                f"the pack has {self.num_classes} classes"
            raise self._bad_record(int(bad[0]), "label", f"is not a class: {named} (labels 0..{self.num_classes - 1})")

    def _check_meta(self, raw) -> dict:
        """The metadata JSON: an object whose known fields have the right types; sets num_classes."""
        def bad(why):
            return PackedFormatError(f"{self.path}: the metadata {why} (a damaged or forged pack: re-run "
                                     f"`fastxfer data pack`)")

        def count(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        try:
            meta = json.loads(bytes(raw).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise bad(f"is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise bad(f"is a JSON {type(meta).__name__}, not an object")
        classes = meta.setdefault("classes", [])
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise bad("field 'classes' is not a list of class names (strings)")
        if len(classes) > MAX_CLASSES:
            raise bad(f"field 'classes' names {len(classes)} classes, over the limit of {MAX_CLASSES}")
        for key, ok, what in (("source", lambda v: isinstance(v, str), "a string"),
                              ("created", lambda v: isinstance(v, str), "a string"),
                              ("tiles", lambda v: isinstance(v, bool), "true or false"),
                              ("skipped", count, "a non-negative integer"),
                              ("untiled", count, "a non-negative integer"),
                              ("num_classes", count, "a non-negative integer")):
            if meta.get(key) is not None and not ok(meta[key]):
                raise bad(f"field {key!r} is {meta[key]!r}, not {what}")
        n = meta.get("num_classes")
        if n is None:  # a pack from before num_classes was written
            labels = self.index["label"]
            n = len(classes) if classes else (max(0, int(labels.max()) + 1) if len(labels) else 0)
            n = min(n, MAX_CLASSES)  # a larger label is then named by _check_index
        elif n > MAX_CLASSES:
            raise bad(f"field 'num_classes' is {n}, over the limit of {MAX_CLASSES}")
        elif classes and n != len(classes):
            raise bad(f"field 'num_classes' is {n} but field 'classes' names {len(classes)} classes")
        self.num_classes = int(n)
        return meta

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

    def cache(self) -> None:
        """Read the whole file into memory (one copy); record() then returns views of that copy,
        still checksummed the first time each is read."""
        if self._blob is None:
            self._blob = bytes(self._mm)

    def record(self, i: int) -> memoryview:
        if not 0 <= i < len(self.index):
            raise IndexError(f"record {i} out of range 0..{len(self.index) - 1}")
        rec = self.index[i]
        off, n = int(rec["offset"]), int(rec["size"])
        source = self._mm if self._blob is None else self._blob
        return self.checked(i, memoryview(source)[off:off + n])

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
        self._blob = None
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
