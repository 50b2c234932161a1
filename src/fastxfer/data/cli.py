"""``fastxfer data pack SRC OUT`` and ``fastxfer data info FILE``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True)
    pk = sub.add_parser("pack", help="pack an image folder (SRC/<class>/<files>) or a list file of 'path label'",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="example:\n  fastxfer data pack photos/ train.fxpack")
    pk.add_argument("src", help="a folder with one sub-folder per class, or a text file of 'path label' lines")
    pk.add_argument("out", help="the pack to write (replaced atomically)")
    pk.add_argument("--no-progress", action="store_true")
    pk.add_argument("--no-tiles", action="store_true",
                    help="store the JPEGs byte for byte instead of transcoding them (losslessly) to tiled JPEGs "
                         "with a restart marker per MCU (smaller files; the loader then decodes more per crop)")
    pk.add_argument("--threads", type=int, default=None, help="reading/transcoding threads (default: all CPUs)")
    info = sub.add_parser("info", help="describe a pack; --verify checks every record's checksum",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="example:\n  fastxfer data info train.fxpack --verify")
    info.add_argument("file")
    info.add_argument("--verify", action="store_true")
    info.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    from fastxfer.data.format import PackedFormatError
    from fastxfer.data.reader import PackedDataset
    from fastxfer.data.writer import pack, read_list_file, scan_image_folder
    from fastxfer.errors import FastxferError

    try:
        if args.data_command == "pack":
            if os.path.isdir(args.src):
                items, classes = scan_image_folder(args.src)
            elif os.path.isfile(args.src):
                items, classes = read_list_file(args.src)
            else:
                raise FastxferError(f"{args.src}: no such folder or list file")
            s = pack(items, args.out, classes, progress=not args.no_progress, source=os.path.abspath(args.src),
                     tiles=False if args.no_tiles else None, threads=args.threads)
            print(f"packed {s['records']} images of {max(s['classes'], 1) if classes else 'unnamed'} classes into "
                  f"{args.out}: {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.1f} s"
                  + (f" ({s['records'] - len(s['untiled'])} tiled)" if s["tiles"] else ""))
            if s["untiled"]:
                print(f"stored {len(s['untiled'])} file(s) as they are (could not transcode them):", file=sys.stderr)
                for path, why in s["untiled"][:20]:
                    print(f"  {path}: {why}", file=sys.stderr)
            if s["skipped"]:  # every skipped file is in the summary dict pack() returns; the first 20 here
                print(f"skipped {len(s['skipped'])} file(s):", file=sys.stderr)
                for path, why in s["skipped"][:20]:
                    print(f"  {path}: {why}", file=sys.stderr)
                if len(s["skipped"]) > 20:
                    print(f"  ... and {len(s['skipped']) - 20} more", file=sys.stderr)
            return 0
        with PackedDataset(args.file, verify=False) as ds:
            labels, counts = np.unique(ds.labels, return_counts=True)
            out = {"file": args.file, "records": len(ds), "bytes": os.path.getsize(args.file),
                   "classes": ds.classes, "num_classes": ds.num_classes,
                   "records_per_label": {int(k): int(v) for k, v in zip(labels, counts)},
                   "height": [int(ds.heights.min()), int(ds.heights.max())] if len(ds) else [],
                   "width": [int(ds.widths.min()), int(ds.widths.max())] if len(ds) else [],
                   "created": ds.meta.get("created"), "source": ds.meta.get("source"),
                   "tiles": bool(ds.meta.get("tiles", False)), "untiled": ds.meta.get("untiled", 0),
                   "skipped_when_packed": ds.meta.get("skipped", 0)}
            bad = ds.verify_all() if args.verify else None
            if bad is not None:
                out["corrupted_records"] = bad
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"{out['file']}: {out['records']} records, {out['bytes'] / 1e6:.1f} MB, "
                  f"{out['num_classes']} classes" + (f" ({out['skipped_when_packed']} file(s) skipped when packed)"
                                                     if out["skipped_when_packed"] else ""))
            if out["tiles"]:
                print(f"  tiled JPEGs (restart marker per MCU): {out['records'] - out['untiled']} of {out['records']}")
            if out["records"]:
                print(f"  sizes: height {out['height'][0]}..{out['height'][1]}, width {out['width'][0]}..{out['width'][1]}")
            for k, v in out["records_per_label"].items():
                name = out["classes"][k] if 0 <= k < len(out["classes"]) else str(k)
                print(f"  label {k} ({name}): {v}")
            if bad is not None:
                print("  checksums: all records intact" if not bad else
                      f"  checksums: {len(bad)} corrupted record(s): {bad[:20]}")
        return 1 if bad else 0
    except (FastxferError, PackedFormatError) as e:
        print(f"fastxfer data: {e}", file=sys.stderr)
        return 1
