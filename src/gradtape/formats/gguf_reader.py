"""A validating GGUF reader: the header, the metadata and the tensor table of a file that
may be truncated, corrupt or hostile.

``GGUFFile(path)`` reads the metadata (key -> python value) and the tensor table (name ->
ggml-order shape, ggml type, a byte view into a read-only memory map) and checks, before
anything is allocated or viewed: the magic and version, every count (tensors, keys, array
items) against the bytes left in the file, every string length, every value type, the
nesting of arrays, the alignment, every tensor's rank, dims, ggml type, byte size, offset
(aligned, inside the file) and that no two tensors' bytes overlap.  Any problem is one
``FileFormatError`` naming the file and the problem; nothing else escapes.  It does not
dequantize and knows nothing about llama (``models.load_gguf`` does both).

We do not use gguf's ``GGUFReader`` for this: it builds a numpy view per metadata item
(seconds on a 49k-token vocabulary) and, on a hostile header, can raise arbitrary
exceptions or try to allocate what the header asks for.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..blocks import ggml_type
from ..errors import FileFormatError

# GGUF value types (gguf's GGUFValueType) -> struct format; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NP_SCALARS = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1",
               10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_INTS = (0, 1, 2, 3, 4, 5, 10, 11)

MAX_DIMS = 4            # ggml's GGML_MAX_DIMS
MAX_NAME = 1 << 16      # a key or tensor name longer than this is corruption
MAX_ARRAY = 1 << 23     # items in one metadata array (vocabularies are < 2^22 tokens)
MAX_NESTING = 4         # arrays of arrays of ...
MAX_ALIGNMENT = 1 << 20
# least bytes a header item can take: key (u64 length) + value type (u32) + a 1-byte value;
# tensor info: name (u64 length) + n_dims (u32) + one dim (u64) + type (u32) + offset (u64)
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


class TensorInfo:
    """One tensor of a GGUF file: ``shape`` in ggml order (fastest dim first), the ggml
    ``tensor_type``, and ``data``: its bytes, a uint8 view shaped like gguf's reader
    (numpy-order rows, the last dim in bytes) ready for ``gguf.quants.dequantize``."""

    __slots__ = ("name", "shape", "tensor_type", "data", "offset", "nbytes")

    def __init__(self, name, shape, tensor_type, data, offset, nbytes):
        self.name, self.shape, self.tensor_type = name, shape, tensor_type
        self.data, self.offset, self.nbytes = data, offset, nbytes

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


class GGUFFile:
    """The metadata (``meta``) and tensors (``tensors``, in file order) of a GGUF file,
    every size checked against the file before use (see the module docstring)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            # an empty file cannot be memory-mapped; it is simply too short
            buf = np.memmap(self.path, dtype=np.uint8, mode="r") if size else b""
        except (OSError, ValueError) as e:
            raise FileFormatError(f"{self.path}: cannot read ({e})") from None
        self._buf, self._mv, self._pos = buf, memoryview(buf), 0
        self.size = len(self._mv)
        if self.size < 4 or bytes(self._mv[:4]) != b"GGUF":
            raise FileFormatError(f"{self.path}: not a GGUF file (bad magic; truncated or "
                                  "another format)")
        self._pos = 4
        version = self._u32("version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 and version else ""
            raise FileFormatError(f"{self.path}: unsupported GGUF version {version}{hint}; "
                                  "versions 2 and 3 are read")
        n_tensors, n_kv = self._u64("tensor count"), self._u64("key count")
        left = self.size - self._pos
        if n_kv > left // _MIN_KV:
            raise FileFormatError(f"{self.path}: header declares {n_kv} metadata keys, more "
                                  f"than its {self.size} bytes can hold (corrupt header)")
        if n_tensors > left // _MIN_TENSOR:
            raise FileFormatError(f"{self.path}: header declares {n_tensors} tensors, more "
                                  f"than its {self.size} bytes can hold (corrupt header)")
        self.version = version
        self.meta = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}", MAX_NAME)
            if key in self.meta:
                raise FileFormatError(f"{self.path}: metadata key {key!r} appears twice")
            vtype = self._u32(f"type of {key!r}")
            self.meta[key] = self._value(vtype, key, 0)
        infos = []
        for i in range(n_tensors):
            infos.append(self._tensor_info(i))
        self.alignment = self._alignment()
        start = -(-self._pos // self.alignment) * self.alignment
        self.data_start = start
        self.tensors = self._place(infos, start)

    def release(self, tensor: "TensorInfo"):
        """Drop this process's mapping of ``tensor``'s whole pages (``MADV_DONTNEED``;
        the file's page cache keeps them): for data that was copied and will not be read
        again through the map, so that it stops counting in the resident set.  Best
        effort: a no-op where the platform cannot."""
        import mmap

        mm = getattr(self._buf, "_mmap", None)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None:
            return
        page = mmap.PAGESIZE
        lo = -(-tensor.offset // page) * page
        hi = (tensor.offset + tensor.nbytes) // page * page
        if hi > lo:
            try:
                mm.madvise(advice, lo, hi - lo)
            except (OSError, ValueError):
                pass

    # --- the primitive readers: each checks the bytes are there first ------------------
    def _need(self, n, what):
        if n > self.size - self._pos:
            raise FileFormatError(f"{self.path}: {what} at byte {self._pos} runs past the end "
                                  f"of the file ({self.size} bytes): truncated or corrupt")

    def _scalar(self, fmt, what):
        size = struct.calcsize("<" + fmt)
        self._need(size, what)
        (v,) = struct.unpack_from("<" + fmt, self._mv, self._pos)
        self._pos += size
        return v

    def _u32(self, what):
        return self._scalar("I", what)

    def _u64(self, what):
        return self._scalar("Q", what)

    def _string(self, what, limit=None):
        n = self._u64(f"length of {what}")
        if limit is not None and n > limit:
            raise FileFormatError(f"{self.path}: {what} declares a length of {n} bytes "
                                  f"(limit {limit}): corrupt header")
        self._need(n, f"{what} ({n} bytes)")
        s = bytes(self._mv[self._pos:self._pos + n])
        self._pos += n
        return s.decode("utf-8", errors="replace")

    def _value(self, vtype, key, depth):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype], f"value of {key!r}")
        if vtype == _STRING:
            return self._string(f"string value of {key!r}")
        if vtype == _ARRAY:
            if depth >= MAX_NESTING:
                raise FileFormatError(f"{self.path}: metadata {key!r} nests arrays more "
                                      f"than {MAX_NESTING} deep")
            itype = self._u32(f"item type of {key!r}")
            count = self._u64(f"item count of {key!r}")
            if itype not in _SCALARS and itype not in (_STRING, _ARRAY):
                raise FileFormatError(f"{self.path}: metadata {key!r}: unknown GGUF value "
                                      f"type {itype} for array items")
            least = np.dtype(_NP_SCALARS[itype]).itemsize if itype in _SCALARS else 8
            if count > MAX_ARRAY or count * least > self.size - self._pos:
                raise FileFormatError(f"{self.path}: metadata {key!r} declares an array of "
                                      f"{count} items, more than the file can hold "
                                      "(corrupt header)")
            if itype in _NP_SCALARS:  # one numpy view for numeric arrays
                dt = np.dtype(_NP_SCALARS[itype])
                arr = np.frombuffer(self._mv, dt, count, self._pos)
                self._pos += count * dt.itemsize
                return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
            return [self._value(itype, key, depth + 1) for _ in range(count)]
        raise FileFormatError(f"{self.path}: metadata {key!r} has unknown GGUF value type "
                              f"{vtype}")

    def _tensor_info(self, i):
        name = self._string(f"name of tensor #{i}", MAX_NAME)
        n_dims = self._u32(f"rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FileFormatError(f"{self.path}: tensor {name!r} has {n_dims} dims (1 to "
                                  f"{MAX_DIMS} allowed)")
        dims = [self._u64(f"dims of tensor {name!r}") for _ in range(n_dims)]
        ttype = self._u32(f"type of tensor {name!r}")
        offset = self._u64(f"data offset of tensor {name!r}")
        return name, dims, ttype, offset

    def _alignment(self):
        align = self.meta.get("general.alignment", 32)
        if (isinstance(align, bool) or not isinstance(align, int) or not
                0 < align <= MAX_ALIGNMENT or align & (align - 1)):
            raise FileFormatError(f"{self.path}: general.alignment {align!r} is not a power "
                                  f"of 2 up to {MAX_ALIGNMENT}")
        return align

    def _place(self, infos, start):
        """Check each tensor's type, size and byte range; return name -> TensorInfo."""
        from gguf import GGMLQuantizationType

        tensors, ranges = {}, []
        for name, dims, ttype, offset in infos:
            if name in tensors:
                raise FileFormatError(f"{self.path}: tensor {name!r} appears twice")
            layout = ggml_type(ttype)  # block size and bytes per block (blocks.py's table)
            if layout is None:
                raise FileFormatError(f"{self.path}: tensor {name!r} has unknown ggml type "
                                      f"{ttype}")
            qtype = GGMLQuantizationType(ttype)
            block, tsize = layout.block, layout.nbytes
            n = 1
            for d in dims:  # python ints: 2^60-element tensors must not wrap around
                n *= d
            if n == 0 or dims[0] % block:
                raise FileFormatError(f"{self.path}: tensor {name!r} dims {dims} do not fit "
                                      f"{qtype.name} blocks of {block} elements")
            nbytes = n // block * tsize
            if offset % self.alignment:
                raise FileFormatError(f"{self.path}: tensor {name!r} data offset {offset} "
                                      f"is not a multiple of the alignment {self.alignment}")
            lo = start + offset
            if nbytes > self.size or lo > self.size - nbytes:
                raise FileFormatError(f"{self.path}: tensor {name!r} ({qtype.name} {dims}: "
                                      f"{nbytes} bytes at byte {lo}) runs past the end of the "
                                      f"file ({self.size} bytes): truncated or corrupt")
            ranges.append((lo, lo + nbytes, name))
            # bytes shaped like gguf's reader: numpy-order rows, the last dim in bytes
            rows = [int(d) for d in reversed(dims[1:])] + [dims[0] // block * tsize]
            data = np.asarray(self._buf[lo:lo + nbytes]).reshape(rows)
            tensors[name] = TensorInfo(name, np.array(dims, dtype=np.int64), qtype, data,
                                       lo, nbytes)
        ranges.sort()
        for (lo0, hi0, a), (lo1, hi1, b) in zip(ranges, ranges[1:]):
            if lo1 < hi0:
                raise FileFormatError(f"{self.path}: the data of tensors {a!r} [{lo0}, {hi0}) "
                                      f"and {b!r} [{lo1}, {hi1}) overlap (corrupt file)")
        return tensors


def check_tokenizer_meta(meta: dict, where: str):
    """The types of the tokenizer keys a GGUF vocabulary needs: lists of strings (tokens,
    merges), a list of ints (token types), int token ids.  Raises ``FileFormatError``."""
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        v = meta.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise FileFormatError(f"{where}: metadata {key} is not a list of strings")
    v = meta.get("tokenizer.ggml.token_type")
    if v is not None and not (isinstance(v, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v)):
        raise FileFormatError(f"{where}: metadata tokenizer.ggml.token_type is not a list of "
                              "integers")
    for key in ("bos", "eos", "unknown", "padding"):
        k = f"tokenizer.ggml.{key}_token_id"
        v = meta.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise FileFormatError(f"{where}: metadata {k} = {v!r} is not an integer")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        v = meta.get(key)
        if v is not None and not isinstance(v, str):
            raise FileFormatError(f"{where}: metadata {key} is not a string")
