"""The input pipeline, by stage: the packed format (format), packing (writer, ``fastxfer data
pack``), reading (reader), augmentation sampling (sampling), decoders (native C++, Numba
reference), the per-rank ``Loader`` (loader) and its Keras / tf.data adapters (adapters)."""

from fastxfer.data.format import CorruptRecordError, PackedFormatError
from fastxfer.data.loader import Loader
from fastxfer.data.reader import PackedDataset
from fastxfer.data.writer import pack, read_list_file, scan_image_folder

__all__ = ["CorruptRecordError", "Loader", "PackedDataset", "PackedFormatError", "pack", "read_list_file",
           "scan_image_folder"]
