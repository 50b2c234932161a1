"""The input pipeline. Today: the packed dataset format (``fastxfer data pack`` / ``info``).
The decode-and-crop kernels and the per-rank loader build on it."""

from fastxfer.data.packed import (CorruptRecordError, PackedDataset, PackedFormatError, pack, read_list_file,
                                  scan_image_folder)

__all__ = ["CorruptRecordError", "PackedDataset", "PackedFormatError", "pack", "read_list_file",
           "scan_image_folder"]
