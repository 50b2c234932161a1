"""The input pipeline: the packed dataset format (``fastxfer data pack`` / ``info``), Numba
decode-and-crop kernels, and the per-rank ``Loader``."""

from fastxfer.data.loader import Loader
from fastxfer.data.packed import (CorruptRecordError, PackedDataset, PackedFormatError, pack, read_list_file,
                                  scan_image_folder)

__all__ = ["CorruptRecordError", "Loader", "PackedDataset", "PackedFormatError", "pack", "read_list_file",
           "scan_image_folder"]
