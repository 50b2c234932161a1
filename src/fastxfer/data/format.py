"""The packed dataset format on disk: layout constants, the header, footer and index structures,
and the errors a reader raises. One memory-mappable file holds every encoded image back to back,
an index (offset, size, CRC-32, label, height, width per record) and the class names.

Layout (little-endian)::

    [header 64 B][records ...][index: count x 24 B][metadata JSON][footer 64 B]

The footer is written last and repeats what the header cannot know in advance (index offset,
record count, index CRC); a file without a valid footer is incomplete. Packing writes to
a fresh hidden ``.OUT.<random>.partial`` beside it and renames it over ``OUT`` only after flushing, so a crash never leaves a
file named OUT that looks valid (writer.py). Every record carries a CRC-32: readers check it
(``verify=True``) and a mismatch raises CorruptRecordError naming the record (reader.py).

The CRCs only catch accidents: a forged file can carry valid ones. So the reader also checks, on
open, every index field against what the format allows (records inside the data region, height
and width >= 1, labels in 0..num_classes-1) and that the metadata is a JSON object with fields of
the right types; anything else is a PackedFormatError naming the record (or metadata field). The
decoders check each record's height and width against its JPEG header before decoding it.

Metadata (a JSON object): ``classes`` (list of class names, may be empty), ``num_classes`` (labels
are 0..num_classes-1; equal to len(classes) when there are names; written since issue 14: older
packs get len(classes), or max label + 1 when unnamed), ``source``, ``created`` (strings),
``tiles`` (bool), ``skipped`` and ``untiled`` (counts).
"""

from __future__ import annotations

import struct

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
MAX_SIDE = 65535  # the index stores height and width as uint16
MAX_CLASSES = 1 << 24  # labels are 0..MAX_CLASSES-1 (a sanity bound: a one-hot batch row is 64 MiB there)


class PackedFormatError(FastxferError):
    """The file is not a complete fastxfer pack (wrong magic, truncated, bad index)."""


class CorruptRecordError(PackedFormatError):
    """A record's bytes do not match its checksum."""
