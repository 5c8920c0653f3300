"""A validating safetensors reader for files that may be truncated, corrupt or hostile.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [lo, hi]}, "__metadata__": {str: str}}``),
then the tensor bytes.  ``read_safetensors`` checks, before viewing any data: the header
length against the file size (and a 100 MB cap), that the header is a JSON object without
duplicate keys, every entry's dtype (one we read), shape (non-negative ints, at most 8
dims), that ``hi - lo`` is exactly ``prod(shape) * itemsize`` (in Python integers: a
2^60-element shape cannot wrap around), that every range lies inside the file, and that no
two ranges overlap.  Any problem is one ``FileFormatError`` naming the file and the
problem.  Data is read from a read-only memory map; nothing is unpickled, ever.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import FileFormatError

DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"),
          "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
          "BOOL": np.dtype("?")}
FLOATS = ("F32", "F64", "F16", "BF16")
MAX_HEADER = 100 << 20  # the reference implementation's limit
MAX_DIMS = 8


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_header(path) -> tuple[dict, dict, int, object]:
    """``(entries, metadata, data_start, buffer)``: the checked header of a safetensors
    file.  ``entries``: name -> (dtype string, shape tuple, absolute byte range)."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
        buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as e:
        raise FileFormatError(f"{path}: cannot read ({e})") from None
    if len(buf) < 8:
        raise FileFormatError(f"{path}: not a safetensors file ({len(buf)} bytes: too short "
                              "for the header length)")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > len(buf) - 8:
        raise FileFormatError(f"{path}: header length {n} is larger than the file "
                              f"({len(buf)} bytes): truncated or not safetensors")
    if n > MAX_HEADER:
        raise FileFormatError(f"{path}: header length {n} exceeds {MAX_HEADER} bytes")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"),
                            object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FileFormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FileFormatError(f"{path}: __metadata__ is not a map of strings")
    start, entries, ranges = 8 + n, {}, []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise FileFormatError(f"{path}: tensor {name!r}: header entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise FileFormatError(f"{path}: tensor {name!r} has dtype {dt!r}; supported: "
                                  f"{', '.join(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise FileFormatError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise FileFormatError(f"{path}: tensor {name!r} has bad data_offsets {offs!r}")
        lo, hi = offs
        count = 1
        for d in shape:  # python ints: no wrap-around
            count *= d
        nbytes = count * DTYPES[dt].itemsize
        if not 0 <= lo <= hi or hi - lo != nbytes:
            raise FileFormatError(f"{path}: tensor {name!r} {dt}{shape}: data_offsets "
                                  f"[{lo}, {hi}) do not hold its {nbytes} bytes")
        if hi > len(buf) - start:
            raise FileFormatError(f"{path}: tensor {name!r} {dt}{shape}: bytes [{lo}, {hi}) "
                                  f"run past the end of the file ({len(buf) - start} data "
                                  "bytes): truncated?")
        entries[name] = (dt, tuple(shape), (start + lo, start + hi))
        ranges.append((lo, hi, name))
    ranges.sort()
    for (lo0, hi0, a), (lo1, hi1, b) in zip(ranges, ranges[1:]):
        if lo1 < hi0:
            raise FileFormatError(f"{path}: the data of tensors {a!r} [{lo0}, {hi0}) and "
                                  f"{b!r} [{lo1}, {hi1}) overlap (corrupt file)")
    return entries, meta, start, buf


def read_safetensors(path, float32=True, floats_only=True, skip=()) -> tuple[dict, dict]:
    """``({name: array}, metadata)`` from a safetensors file, every size checked first.

    ``float32``: convert float tensors (F16, BF16, F32, F64) to float32; otherwise keep
    their dtype (BF16, which NumPy lacks, always becomes float32).  ``floats_only``:
    refuse integer and bool tensors.  ``skip``: names left out."""
    path = Path(path)
    entries, meta, _, buf = read_header(path)
    out = {}
    for name, (dt, shape, (lo, hi)) in entries.items():
        if name in skip:  # the caller reads these itself (e.g. as 2-byte blocks)
            continue
        if floats_only and dt not in FLOATS:
            raise FileFormatError(f"{path}: tensor {name!r} has dtype {dt}; only "
                                  f"{', '.join(FLOATS)} are supported here")
        d = DTYPES[dt]
        raw = np.frombuffer(buf, d, (hi - lo) // d.itemsize, lo)
        if dt == "BF16":  # bfloat16 is the top half of a float32
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        elif float32 and dt in FLOATS:
            arr = raw.astype(np.float32)
        else:
            arr = raw.copy()
        out[name] = arr.reshape(shape)
    return out, meta
