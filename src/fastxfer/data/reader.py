"""Reading a pack: ``PackedDataset``, a read-only memory map of the file with its index checked
on open and each record's CRC-32 checked the first time this process reads it (format.py has
the layout)."""

from __future__ import annotations

import json
import mmap
import os
import zlib

import numpy as np

from fastxfer.data.format import (DATA_OFFSET, FOOTER, FOOTER_MAGIC, HEADER, INDEX_DTYPE, MAGIC, VERSION,
                                  CorruptRecordError, PackedFormatError)


class PackedDataset:
    """Read-only, memory-mapped view of a pack. ``len(ds)``, ``ds.labels``, ``ds.heights``,
    ``ds.widths``, ``ds.record(i)`` (a zero-copy memoryview of the encoded bytes; with verify=True
    its CRC is checked the first time this process reads it), ``ds.classes``."""

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
