"""oneDNN's matmul through ctypes: bf16 inputs, float32 accumulation and output (and,
in a bf16 program, the float32 matmuls too: ``bind_f32``).

The accelerator of the cpu backend's frozen-weight GEMMs in bf16 (``--compute auto|bf16``):
oneDNN 3.2, the ``onednn-cpu-gomp`` wheel (a dependency on Linux x86-64), a plain shared
library using the system libgomp, the OpenMP runtime our generated C uses too;
``$GRADTAPE_DNNL`` may name another ``libdnnl.so.3``.  oneDNN picks the kernel for
the CPU at run time: AMX tiles where present, AVX512-BF16 dot products elsewhere
(``describe()`` names what it chose).  Primitives are created once per shape and cached;
memory objects are bound once to the backend's fixed buffers (or, for the tiles of block
weights, to raw addresses with row strides: ``bind_ptrs``), so a call is one execute.

This module knows nothing of graphs; ``backend.py`` decides which matmuls run here.  Failing to
load, or a CPU oneDNN has no bf16 matmul for, is reported by ``available()`` as a reason,
never raised at import.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ... import settings
from . import toolchain

_F32, _BF16, _S32, _S8, _U8 = 3, 2, 4, 5, 6  # dnnl_data_type_t
_CPU = 1  # dnnl_engine_kind_t
_IN_ORDER = 1  # dnnl_stream_flags_t
_ARG_SRC, _ARG_WEIGHTS, _ARG_DST = 1, 33, 17
_QUERY_IMPL_INFO = 8  # dnnl_query_impl_info_str
_QUERY_STRIDES, _QUERY_WEIGHTS_MD = 14, 131  # dnnl_query_t
_QUERY_PADDED_DIMS, _QUERY_FORMAT_KIND = 260, 262
_QUERY_INNER_NBLKS, _QUERY_INNER_BLKS, _QUERY_INNER_IDXS = 263, 264, 265
_FORMAT_ANY, _FORMAT_BLOCKED = 1, 2  # dnnl_format_tag_any, dnnl_blocked
# the weights layout of oneDNN's bf16 matmul kernels (BA16a64b2a): [K, N] in panels of 64
# columns, each [K / 2][64][2] with K padded to 32 (csrc/qgemm.c's gt_deq_tile_vnni)
VNNI_INNER = ((0, 16), (1, 64), (0, 2))
VNNI_INNER_S8 = ((0, 16), (1, 64), (0, 4))  # BA16a64b4a: int8, four values of K a word
_vp = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _vp)]


class DnnlError(RuntimeError):
    pass


@dataclass(frozen=True)
class Gemm:
    """The shape and layouts of one matmul ``out [m, n] (+)= op(a) [m, k] @ op(W) [k, n]``:
    a and W bf16 (int8 where ``s8``), out float32 (int32 where ``s8``)."""

    m: int
    k: int
    n: int
    tb: bool = False  # W stored [n, k] (ignored where vnni or packed)
    lda: int | None = None  # a's rows this many values apart (default k; m where ta)
    ldc: int | None = None  # out's rows this many values apart (default n)
    acc: bool = False  # the product added to out instead of written
    vnni: bool = False  # W in the kernel's blocked layout (VNNI_INNER, VNNI_INNER_S8)
    packed: bool = False  # W in the kernel's own layout, as ``pack`` wrote it
    s8: bool = False  # a and W int8 (a as u8 where vnni), out int32: exact sums
    ta: bool = False  # a stored [k, m] (a weight's gradient x^T dY)

    def normal(self):
        """The same matmul with the defaults spelled out (one primitive per such)."""
        return replace(self, tb=self.tb and not (self.vnni or self.packed),
                       lda=(self.m if self.ta else self.k) if self.lda is None else self.lda,
                       ldc=self.n if self.ldc is None else self.ldc)


def _library_path():
    env = settings.get("GRADTAPE_DNNL")
    if env:
        return env
    try:
        import importlib.metadata as md
        dist = md.distribution("onednn-cpu-gomp")
    except Exception:  # not installed
        return None
    for f in dist.files or ():
        if Path(str(f)).name == "libdnnl.so.3":
            return str(dist.locate_file(f))
    return None


class _Dnnl:
    """One engine and stream per process; primitives cached by shape."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        for name in ("dnnl_engine_create", "dnnl_stream_create", "dnnl_stream_wait",
                     "dnnl_memory_desc_create_with_strides", "dnnl_memory_create",
                     "dnnl_matmul_primitive_desc_create", "dnnl_primitive_desc_query",
                     "dnnl_primitive_create", "dnnl_primitive_execute", "dnnl_version",
                     "dnnl_memory_desc_create_with_tag", "dnnl_memory_desc_query",
                     "dnnl_memory_destroy", "dnnl_memory_desc_equal",
                     "dnnl_memory_desc_get_size", "dnnl_reorder_primitive_desc_create",
                     "dnnl_primitive_destroy", "dnnl_primitive_desc_destroy",
                     "dnnl_memory_desc_destroy",
                     "dnnl_post_ops_create", "dnnl_post_ops_append_sum",
                     "dnnl_primitive_attr_create", "dnnl_primitive_attr_set_post_ops"):
            getattr(lib, name)  # AttributeError: not a oneDNN 3 library
        lib.dnnl_version.restype = ctypes.POINTER(ctypes.c_int * 3)
        lib.dnnl_primitive_desc_query_md.restype = _vp
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_equal.argtypes = [_vp, _vp]
        self.lib = lib
        v = lib.dnnl_version().contents
        self.version = f"{v[0]}.{v[1]}.{v[2]}"
        if v[0] != 3:
            raise DnnlError(f"oneDNN {self.version} at {path}: need oneDNN 3.x")
        self.engine, self.stream = _vp(), _vp()
        self._ok(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, 0), "engine_create")
        self._ok(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER),
                 "stream_create")
        self._prims = {}
        self._sum_attr = None

    @staticmethod
    def _ok(status, what):
        if status != 0:
            raise DnnlError(f"oneDNN {what} failed (status {status})")

    def _md(self, shape, strides, dtype):
        m = _vp()
        self._ok(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(m), len(shape), _Dims(*shape), dtype, _Dims(*strides)),
            "memory_desc_create")
        return m

    def _accumulate(self):
        """Primitive attributes adding the product to dst (a "sum" post-op)."""
        if self._sum_attr is None:
            ops, attr = _vp(), _vp()
            self._ok(self.lib.dnnl_post_ops_create(ctypes.byref(ops)), "post_ops_create")
            self._ok(self.lib.dnnl_post_ops_append_sum(ops, ctypes.c_float(1.0), 0, 0),
                     "post_ops_append_sum")
            self._ok(self.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr_create")
            self._ok(self.lib.dnnl_primitive_attr_set_post_ops(attr, ops), "set_post_ops")
            self._sum_attr = attr
        return self._sum_attr

    def primitive(self, gemm: Gemm):
        """``(primitive, (src, weights, dst) descs, impl name)`` of the matmul ``gemm``, or
        None where it asks for ``vnni`` and the kernel oneDNN picks on this CPU keeps its
        weights in another layout than ``VNNI_INNER`` (``VNNI_INNER_S8``)."""
        key = gemm.normal()
        if key in self._prims:
            return self._prims[key]
        m, k, n, tb, lda, ldc = key.m, key.k, key.n, key.tb, key.lda, key.ldc
        acc, vnni, packed, s8, ta = key.acc, key.vnni, key.packed, key.s8, key.ta
        inputs, name = (_S8, "int8") if s8 else (_BF16, "bf16")
        # int8 in the blocked layout: the activation as u8 (q + 128), whose kernels keep
        # their weights without a compensation term of their own
        src = self._md((m, k), (1, lda) if ta else (lda, 1), _U8 if s8 and vnni else inputs)
        if vnni or packed:
            wei = _vp()
            self._ok(self.lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(wei), 2, _Dims(k, n), inputs, _FORMAT_ANY), "memory_desc")
        else:
            wei = self._md((k, n), (1, k) if tb else (n, 1), inputs)
        dst = self._md((m, n), (ldc, 1), _S32 if s8 else _F32)
        pd = _vp()
        self._ok(self.lib.dnnl_matmul_primitive_desc_create(
            ctypes.byref(pd), self.engine, src, wei, None, dst,
            self._accumulate() if acc else None),
            f"matmul [{m}, {k}] x [{k}, {n}] {name} (no {name} matmul on this CPU?)")
        if vnni or packed:
            wei = _vp(self.lib.dnnl_primitive_desc_query_md(pd, _QUERY_WEIGHTS_MD, 0))
            if vnni and not self._is_vnni(wei, k, n, s8):
                self._prims[key] = None
                return None
        info = ctypes.c_char_p()
        self._ok(self.lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO, 0,
                                                     ctypes.byref(info)), "query")
        prim = _vp()
        self._ok(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive")
        hit = self._prims[key] = (prim, (src, wei, dst), (info.value or b"?").decode())
        return hit

    def _is_vnni(self, md, k, n, s8=False):
        """Whether the weights descriptor ``md`` of a ``[k, n]`` B is ``VNNI_INNER`` with
        K padded to 32, N to 64 and the panels ``Kp * 64`` values apart (``s8``:
        ``VNNI_INNER_S8``, K padded to 64: what ``gt_deq_tile_s8_vnni`` writes)."""
        def query(what, ctype):
            v = ctype()
            self._ok(self.lib.dnnl_memory_desc_query(md, what, ctypes.byref(v)), "md query")
            return v
        kp, np_ = -(-k // (64 if s8 else 32)) * (64 if s8 else 32), -(-n // 64) * 64
        if query(_QUERY_FORMAT_KIND, ctypes.c_int).value != _FORMAT_BLOCKED:
            return False
        nb = query(_QUERY_INNER_NBLKS, ctypes.c_int).value
        blks, idxs, pad, strides = (query(q, ctypes.POINTER(ctypes.c_int64)) for q in (
            _QUERY_INNER_BLKS, _QUERY_INNER_IDXS, _QUERY_PADDED_DIMS, _QUERY_STRIDES))
        inner = VNNI_INNER_S8 if s8 else VNNI_INNER
        return (tuple((idxs[i], blks[i]) for i in range(nb)) == inner
                and (pad[0], pad[1]) == (kp, np_)
                and (strides[0], strides[1]) == (4096 if s8 else 2048, kp * 64))

    def pack(self, m, k, n, tb, w, out=None):
        """``w`` (bf16 ``[k, n]``, or ``[n, k]`` when ``tb``) reordered into the layout
        oneDNN's kernel for ``[m, k] @ [k, n]`` keeps its weights in, as a new uint8
        array (or into ``out``, an earlier pack of the same product) with the layout's
        descriptor: ``(array, md)``.  Where that kernel reads its weights in place (a
        layout equal to ``w``'s own), ``(None, md)``."""
        _, (_, md, _), _ = self.primitive(Gemm(m, k, n, packed=True))
        if not self.packs(m, k, n, tb):
            return None, md
        if out is None:
            out = np.empty(self.lib.dnnl_memory_desc_get_size(md), np.uint8)
        self.bind_pack(m, k, n, tb, w.ctypes.data, out.ctypes.data, out.nbytes)()
        return out, md

    def bind_pack(self, m, k, n, tb, w, out, room):
        """``pack``'s reorder on raw addresses, as a callable doing it again on each call:
        ``w`` bf16 ``[k, n]`` (``[n, k]`` where ``tb``) into ``out``, ``room`` bytes (at
        least ``packed_bytes``).  The memory must outlive the callable, whose oneDNN
        handles go with it."""
        _, (_, md, _), _ = self.primitive(Gemm(m, k, n, packed=True))
        if self.lib.dnnl_memory_desc_get_size(md) > room:
            raise ValueError(f"bind_pack: {room} bytes for a packed [{k}, {n}]")
        plain = self._md((k, n), (1, k) if tb else (n, 1), _BF16)
        pd, prim = _vp(), _vp()
        self._ok(self.lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(pd), plain, self.engine, md, self.engine, None), "reorder")
        self._ok(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive")
        self.lib.dnnl_primitive_desc_destroy(pd)
        mems = [self._memory(plain, w), self._memory(md, out)]
        args = (_Arg * 2)(_Arg(_ARG_SRC, mems[0]), _Arg(_ARG_DST, mems[1]))
        execute, wait, stream, ok = (self.lib.dnnl_primitive_execute,
                                     self.lib.dnnl_stream_wait, self.stream, self._ok)

        def run():
            ok(execute(prim, stream, 2, args), "execute")
            ok(wait(stream), "stream_wait")
        lib = self.lib
        for destroy, handles in ((lib.dnnl_memory_destroy, mems),
                                 (lib.dnnl_primitive_destroy, [prim]),
                                 (lib.dnnl_memory_desc_destroy, [plain])):
            weakref.finalize(run, _destroy, destroy, handles).atexit = False
        return run

    def packed_bytes(self, m, k, n):
        """The bytes of ``pack``'s layout for the kernel of ``[m, k] @ [k, n]``."""
        _, (_, md, _), _ = self.primitive(Gemm(m, k, n, packed=True))
        return self.lib.dnnl_memory_desc_get_size(md)

    def packs(self, m, k, n, tb):
        """Whether ``pack`` would reorder a ``[k, n]`` W (``[n, k]`` where ``tb``) for the
        kernel of ``[m, k] @ [k, n]``: False where that kernel reads it in place."""
        _, (_, md, _), _ = self.primitive(Gemm(m, k, n, packed=True))
        plain = self._md((k, n), (1, k) if tb else (n, 1), _BF16)
        try:
            return not self.lib.dnnl_memory_desc_equal(md, plain)
        finally:
            self.lib.dnnl_memory_desc_destroy(plain)

    def same_layout(self, md, m, k, n):
        """Whether the kernel for ``[m, k] @ [k, n]`` keeps its weights as ``md`` says
        (then a weight ``pack`` wrote for another row count serves it too)."""
        _, (_, want, _), _ = self.primitive(Gemm(m, k, n, packed=True))
        return bool(self.lib.dnnl_memory_desc_equal(md, want))

    def vnni(self, m, k, n, s8=False):
        """Whether the bf16 matmul of ``[m, k] @ [k, n]`` takes its weights in the blocked
        layout ``gt_deq_tile_vnni`` writes (then no reorder per call); ``s8``: the int8
        one (u8 activation), in the layout of ``gt_deq_tile_s8_vnni``."""
        return self.primitive(Gemm(m, k, n, vnni=True, s8=s8)) is not None

    def _f32_primitive(self, out, a, b):
        """``(primitive, (src, weights, dst) descs, "f32")`` of the float32 ``out = a @
        b`` at these shapes and strides, or None where oneDNN has no matmul for it."""
        shapes = [x.shape for x in (a, b, out)]
        if (not all(x.dtype == np.float32 for x in (a, b, out)) or a.ndim != b.ndim
                or a.ndim != out.ndim or a.ndim not in (2, 3) or a.shape[:-2] != b.shape[:-2]
                or a.shape[:-2] != out.shape[:-2] or 0 in a.shape + b.shape):
            return None
        key = ("f32", *shapes, a.strides, b.strides, out.strides)
        if key not in self._prims:
            mds = [self._md(x.shape, tuple(st // 4 for st in x.strides), _F32)
                   for x in (a, b, out)]
            pd = _vp()
            if self.lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), self.engine,
                                                          mds[0], mds[1], None, mds[2],
                                                          None) != 0:
                self._prims[key] = None
                return None
            prim = _vp()
            self._ok(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive")
            self._prims[key] = (prim, mds, "f32")
        return self._prims[key]

    def bind_f32(self, out, a, b):
        """A callable computing ``out = a @ b`` in float32 (``np.matmul``'s rule, for 2-d
        matrices or batches of equal shape; any element strides, such as a transposed
        view), or None where oneDNN has no matmul for it."""
        hit = self._f32_primitive(out, a, b)
        if hit is None:
            return None
        prim, mds, _ = hit
        run = self._bound(prim, mds, (a.ctypes.data, b.ctypes.data, out.ctypes.data),
                          keep=(a, b, out))
        run.label = f"matmul f32 (oneDNN) {a.shape} x {b.shape}"
        return run

    def matmul_f32(self, out, a, b):
        """``out = a @ b`` in float32 run once now (``bind_f32``'s rule; for operands
        whose addresses change from call to call), or False where oneDNN has no matmul
        for it."""
        hit = self._f32_primitive(out, a, b)
        if hit is None:
            return False
        self._run_once(hit, (a.ctypes.data, b.ctypes.data, out.ctypes.data))
        return True

    def _bound(self, prim, mds, ptrs, keep=()):
        """A callable executing the matmul ``prim`` on the addresses ``ptrs`` (src,
        weights, dst; ``mds`` their descriptors).  Its memory objects, and the arrays
        ``keep`` behind those addresses, live as long as the callable: a program dropped
        frees its arena (a process may build many, such as the attention probe's or a
        chat's prompt sizes)."""
        mems = [self._memory(md, ptr) for md, ptr in zip(mds, ptrs)]
        args = (_Arg * 3)(*(_Arg(kind, h) for kind, h in
                            zip((_ARG_SRC, _ARG_WEIGHTS, _ARG_DST), mems)))
        execute, wait, stream, ok = (self.lib.dnnl_primitive_execute,
                                     self.lib.dnnl_stream_wait, self.stream, self._ok)

        def run():
            ok(execute(prim, stream, 3, args), "execute")
            ok(wait(stream), "stream_wait")
        run.keep = keep
        # the handles go with the callable (not at exit: the process frees them then)
        weakref.finalize(run, _destroy, self.lib.dnnl_memory_destroy, mems).atexit = False
        return run

    def _memory(self, md, ptr):
        h = _vp()
        self._ok(self.lib.dnnl_memory_create(ctypes.byref(h), md, self.engine, _vp(ptr)),
                 "memory_create")
        return h

    def bind(self, out, a, w, tb, packed=False):
        """A callable computing ``out = a @ op(w)`` (``a`` [m, k] bf16 as uint16, ``w`` bf16
        ``[k, n]`` or ``[n, k]`` when ``tb``, or as ``pack`` wrote it where ``packed``;
        ``out`` float32 [m, n]); it keeps the arrays alive, which must stay in place."""
        run = self.bind_ptrs(Gemm(a.shape[0], a.shape[1], out.shape[1], tb, packed=packed),
                             a.ctypes.data, w.ctypes.data, out.ctypes.data)
        run.keep = (a, w, out)
        return run

    def gemm(self, gemm: Gemm, a, w, out):
        """``bind_ptrs``' product run once now, its memory objects freed after: for
        operands whose addresses change from call to call."""
        self._run_once(self.primitive(gemm), (a, w, out))

    def _run_once(self, hit, ptrs):
        """Execute the matmul ``hit`` (``primitive``'s triple) on the addresses ``ptrs``
        (src, weights, dst), its memory objects freed after (with the callable)."""
        prim, mds, _ = hit
        self._bound(prim, mds, ptrs)()

    def bind_ptrs(self, gemm: Gemm, a, w, out):
        """The same on raw addresses, the matmul ``gemm``: ``a`` [m, k], ``w`` (as in
        ``bind``, or in the blocked layout where ``vnni``: check ``vnni(m, k, n)`` first,
        or as ``pack`` wrote it where ``packed``), ``out`` [m, n]; the memory must outlive
        the callable."""
        prim, mds, _ = self.primitive(gemm)
        return self._bound(prim, mds, (a, w, out))


def _destroy(destroy, handles):
    for h in handles:
        destroy(h)


@functools.lru_cache(maxsize=1)
def _library():
    """``(_Dnnl, "")`` when the library loads (its float32 matmul runs on any x86-64), or
    ``(None, why)``."""
    path = _library_path()
    if path is None:
        return None, ("oneDNN is not installed (pip install onednn-cpu-gomp==2023.2.0, or "
                      "set $GRADTAPE_DNNL to a libdnnl.so.3)")
    toolchain.quiet_openmp()  # oneDNN's threads are libgomp's, shared with our kernels
    try:
        return _Dnnl(path), ""
    except (OSError, AttributeError, DnnlError) as e:
        return None, f"oneDNN could not be used ({path}: {e})"


@functools.lru_cache(maxsize=1)
def _load():
    """``(_Dnnl, "")`` where it also has a bf16 matmul for this CPU, or ``(None, why)``."""
    d, why = _library()
    if d is None:
        return None, why
    try:
        d.primitive(Gemm(16, 64, 64))
    except DnnlError as e:
        return None, f"oneDNN could not be used ({_library_path()}: {e})"
    return d, ""


def available():
    """``(True, "")`` when oneDNN loads and has a bf16 matmul here, else ``(False, why)``."""
    d, why = _load()
    return d is not None, why


def dnnl():
    """The library with its bf16 matmul (``DnnlError`` saying why not)."""
    d, why = _load()
    if d is None:
        raise DnnlError(why)
    return d


def library():
    """The library for float32 matmuls alone (``DnnlError`` saying why not)."""
    d, why = _library()
    if d is None:
        raise DnnlError(why)
    return d


def describe(shape=(256, 576, 1536)):
    """What runs the bf16 GEMMs: library, version and oneDNN's kernel name (its ISA)."""
    d, why = _load()
    if d is None:
        return f"none ({why})"
    return f"oneDNN {d.version} ({d.primitive(Gemm(*shape))[2]})"


def to_bf16(x, out=None):
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN.  A host-side
    helper for weights converted once and for tests (the per-step activations are
    converted by a C kernel, ``codegen.ProgramSource.bf16_kernel``)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = 0x7FC0
    if out is not None:
        out[...] = r
        return out
    return r


def from_bf16(b):
    """bf16 bits (uint16) -> float32, exactly."""
    return (np.asarray(b, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
