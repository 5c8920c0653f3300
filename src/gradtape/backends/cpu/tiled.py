"""The C side of the tiled primitives (``gradtape/tiled.py``: the tiled attention and
the fused LM head): the same methods as ``tiled.NumpyTiles``, one C loop over a block's
rows each (OpenMP over the rows; ``csrc/tiled.c``), so a block of scores is read and
written once per step instead of once per NumPy call, and the whole attention as one call
(``csrc/flash.c``).  The walk over the blocks is ``gradtape/tiled.py``'s own; the head's
GEMMs are its ``HeadGemms``, or here in oneDNN (``Bf16HeadGemms``, ``OnednnHeadGemms``).

Math as in ``NumpyTiles``, in the block's dtype (row sums as ``csrc/tiled.c`` says);
float32 ``exp`` is the generated kernels' vectorizable ``gt_expf``; masked entries are
exactly 0.  Without a C compiler the cpu backend runs on NumPy anyway
(``CpuBackend.unavailable``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ... import tiled
from ...blocks import BLOCK_TYPES
from ..base import page_aligned
from . import blas, measure, onednn, qgemm, toolchain
from .onednn import Gemm

def _lib():
    return toolchain.csrc_library(["flash.c"], "tiled")


def _p(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


_L, _D = ctypes.c_long, ctypes.c_double


class CTiles:
    """``tiled.NumpyTiles``' methods as C loops, for one float dtype; ``bf16``: the fused
    attention's GEMMs take bf16 inputs (float32 sums; ``--compute bf16``);
    ``f32_onednn``: the fused head's float32 GEMMs run in oneDNN (as the program's other
    matmuls, ``backend.CpuBackend._f32_gemms``); ``only``: the ways of the fused head's
    bf16 products the execution plan leaves (``measure.fastest``); ``trained_bf16``: the
    fused head's trained table gets its gradient with bf16 inputs too (full
    fine-tuning)."""

    def __init__(self, dtype, bf16=False, f32_onednn=False, only=((), ""),
                 trained_bf16=False):
        self.only = only
        self.suf = "f32" if np.dtype(dtype) == np.float32 else "f64"
        lib = _lib()
        self.f = {name: getattr(lib, f"gt_{name}_{self.suf}")
                  for name in ("head_fwd", "head_dz", "attn_fwd", "attn_p", "attn_ds")}
        for fn in self.f.values():
            fn.restype = None
        gemms = "bf16" if bf16 else "f32"
        self.flash = ((getattr(lib, f"gt_flash_fwd_{gemms}"),
                       getattr(lib, f"gt_flash_bwd_{gemms}")) if self.suf == "f32" else None)
        self.lanes = lib.gt_flash_lanes()  # of the GEMM blocks' vectors (0: plain C)
        # whether the bf16 GEMMs are the CPU's instructions (else plain C: for the tests)
        self.bf16_native = bool(lib.gt_flash_bf16_native())
        self.head_gemms = self.grad_w_gemms = tiled.HeadGemms
        if self.suf == "f32" and (bf16 or f32_onednn):
            self.head_gemms = Bf16HeadGemms if bf16 else OnednnHeadGemms
        if self.suf == "f32" and f32_onednn:  # a trained table's gradient: one thread pool
            self.grad_w_gemms = OnednnHeadGemms
        if self.suf == "f32" and trained_bf16:
            self.grad_w_gemms = Bf16HeadGemms
        self._buffers = {}

    def buffer(self, name, shape, dtype):
        """The scratch array ``name`` of a walk, kept for its next call (grown when that
        asks for more).  A new array of tens of MB each call costs its page faults each
        step again, and where NumPy asks for huge pages for it, the kernel's compaction
        to find them: ten times the work of the kernel writing into it."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        raw = self._buffers.get(name)
        if raw is None or raw.size < n:
            raw = self._buffers[name] = page_aligned(n, np.uint8)
        return raw[:n].view(dtype).reshape(shape)

    def release(self, *names):
        """Drop the kept scratch arrays ``names`` (a way of a walk not taken after all)."""
        for name in names:
            self._buffers.pop(name, None)

    def table_rows(self, w, v0, v1, qtype, k, dtype):
        """``tiled.NumpyTiles.table_rows`` by the C kernels (the same bits as gguf's),
        into a kept buffer; float64 by the reference."""
        if np.dtype(dtype) != np.float32:
            return tiled.NUMPY_TILES.table_rows(w, v0, v1, qtype, k, dtype)
        out = self.buffer("head rows", (v1 - v0, k), np.float32)
        return qgemm.deq_rows(w[v0:v1], qtype, k, out=out)

    def fused_attn(self, out, q, k, v, lay, spec, gy=None, y=None):
        """The whole of ``tiled.fwd_attn`` (``gy`` None) or ``fwd_attn_grad`` as one
        call of ``csrc/flash.c``, for the call ``spec`` (a ``tiled.AttentionSpec``) laid
        out by ``lay``; False where it does not apply (float64, segment ids that are not
        contiguous runs: the walk of ``tiled.py`` runs them)."""
        if self.flash is None or (lay.seg is not None and lay.starts is None):
            return False
        blas.park_blas_threads()  # or they poll on the cores the call's threads need
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        starts = None if lay.starts is None else np.ascontiguousarray(lay.starts, np.int64)
        dims = (_L(lay.n_seq), _L(q.shape[0]), _L(k.shape[0]), _L(spec.nh), _L(spec.nkv),
                _L(spec.hd), _D(spec.iscale), _D(spec.softcap), _L(spec.window))
        if gy is None:
            rc = self.flash[0](_p(out), _p(q), _p(k), _p(v), _p(starts), *dims)
        else:
            gy, y = np.ascontiguousarray(gy), np.ascontiguousarray(y)
            rc = self.flash[1](_p(out), _p(gy), _p(q), _p(k), _p(v), _p(y), _p(starts), *dims)
        if rc:
            raise MemoryError("the fused attention's scratch could not be allocated")
        return True

    def head_fwd(self, z, m, s, picked, ids, v0, cap):
        self.f["head_fwd"](_p(z), _L(z.strides[0] // z.itemsize), _p(m), _p(s), _p(picked),
                           _p(ids), _L(z.shape[0]), _L(z.shape[1]), _L(v0), _D(cap))

    def head_dz(self, z, lse, a, b, ids, v0, cap):
        self.f["head_dz"](_p(z), _L(z.strides[0] // z.itemsize), _p(lse), _p(a), _p(b),
                          _p(ids), _L(z.shape[0]), _L(z.shape[1]), _L(v0), _D(cap))

    @staticmethod
    def _vis(vis):
        """``lo, hi`` pointers of a ``tiled.Visible`` (null for None) and its mask as
        uint8 (or None)."""
        if vis is None:
            return _p(None), _p(None), None
        mk = None if vis.mask is None else np.ascontiguousarray(vis.mask, np.uint8)
        return _p(vis.lo), _p(vis.hi), mk

    def attn_fwd(self, s, m, l, acc, iscale, cap, vis, g):
        lo, hi, mk = self._vis(vis)
        nkv, gn, ncol = s.shape
        self.f["attn_fwd"](_p(s), _p(m), _p(l), _p(acc), lo, hi, _p(mk), _L(nkv * gn),
                           _L(ncol), _L(gn // g), _L(acc.shape[2]), _D(iscale), _D(cap))

    def attn_p(self, s, t, lse, iscale, cap, vis, g):
        lo, hi, mk = self._vis(vis)
        nkv, gn, ncol = s.shape
        self.f["attn_p"](_p(s), _p(t), _p(lse), lo, hi, _p(mk), _L(nkv * gn), _L(ncol),
                         _L(gn // g), _D(iscale), _D(cap))

    def attn_ds(self, dp, p, t, D, iscale, cap):
        nkv, gn, ncol = dp.shape
        self.f["attn_ds"](_p(dp), _p(p), _p(t), _p(np.ascontiguousarray(D)), _L(nkv * gn),
                          _L(ncol), _D(iscale), _D(cap))


def flash_gemms(spec, nq, nk, starts=None, grad=False):
    """The GEMMs one call of ``csrc/flash.c`` performs for the attention call ``spec``
    over ``nq`` query and ``nk`` key rows (``starts``: each row's packed example's first
    position, or None), the forward or (``grad``) its VJP, each as ``(m, k, n, ta, tb)``:
    ``C [m, n] = A [m, k] @ B [k, n]`` with A, B given transposed where ``ta``, ``tb`` say
    (as NumPy would take the operands flash.c reads).  The walk mirrors flash.c's: a unit
    of ``gt_flash_unit_rows`` query rows of one kv head (its g heads stacked, ``M = g *
    n`` rows) multiplies every key tile of ``gt_flash_key_tile`` keys from its rows' first
    visible key (down to a panel's start) to its last row's position, all M rows in full:
    forward ``S = Q K^T``, ``O += P V``; backward ``S = Q K^T``, ``dV += P^T dO``, ``dP =
    dO V^T``, ``dK += dS^T Q``, ``dQ += dS K``.  A GEMM floor counts these
    (``bench/lora_bench.py``); ``tests/backends/test_flash_gemms.py`` holds the list to
    the calls flash.c logs."""
    lib = _lib()
    kt, nr = lib.gt_flash_key_tile(), lib.gt_flash_panel()
    g, hd, n_seq = spec.nh // spec.nkv, spec.hd, spec.n_seq
    tq, tk = nq // n_seq, nk // n_seq
    past, rows = tk - tq, lib.gt_flash_unit_rows(_L(g), _L(tq))
    def xyt(m, kn):  # [m, kn] = [m, hd] [kn, hd]^T: S = Q K^T, dP = dO V^T
        return m, hd, kn, False, True

    def ay(m, kn):  # [m, hd] = [m, kn] [kn, hd]: O += P V, dQ += dS K
        return m, kn, hd, False, False

    def atx(m, kn):  # [kn, hd] = [m, kn]^T [m, hd]: dV += P^T dO, dK += dS^T Q
        return kn, m, hd, True, False

    out = []
    for b in range(n_seq):
        for i0 in range(0, tq, rows):
            n = min(rows, tq - i0)
            pos = past + i0 + np.arange(n)  # each row's position; it sees keys < pos + 1
            first = np.maximum(pos - spec.window + 1, 0) if spec.window > 0 else 0 * pos
            if starts is not None:
                first = np.maximum(first, starts[b * tq + i0:b * tq + i0 + n])
            jlo, jhi, m = int(first.min()), int(pos.max()) + 1, g * n
            for j0 in range(jlo - jlo % nr, jhi, kt):
                kn = min(kt, jhi - j0)
                if grad:  # S, dV, dP, dK, dQ
                    tile = [xyt(m, kn), atx(m, kn), xyt(m, kn), atx(m, kn), ay(m, kn)]
                else:  # S, O
                    tile = [xyt(m, kn), ay(m, kn)]
                out += tile * spec.nkv  # the same for each kv head
    return out


def _f32_bf16(x, out, n):
    qgemm.lib().gt_f32_bf16(x.ctypes.data, out.ctypes.data, n)


class Bf16HeadGemms:
    """``tiled.HeadGemms`` with bf16 inputs and float32 sums, in oneDNN (``--compute
    bf16``): ``x`` is rounded once, each block of table rows as it is taken (dequantized
    straight into bf16 from its ggml blocks), each block of weights ``z`` before its
    product.

    A block table's rows go either into plain rows, which each GEMM reorders into its
    kernel's layout, or twice straight into that blocked layout (``gt_deq_tile_vnni``:
    once as W^T for the logits, once as W for the weighing), whichever
    ``measure.fastest`` measures faster at the shape (once per CPU; "head Q6_K"): the
    blocked layout saves the GEMMs' reorders and costs a second dequantization, and
    which wins depends on the CPU's kernels."""

    def __init__(self, x, w, qtype, kern):
        self.dnnl, self.kern = onednn.dnnl(), kern
        self.T, self.D = x.shape
        self.x16 = kern.buffer("head x16", x.shape, np.uint16)
        _f32_bf16(np.ascontiguousarray(x), self.x16, x.size)
        # a float table of any strides is made contiguous a block of rows at a time (a
        # transposed one never costs a whole copy); a block table's rows are read in place
        self.w, self.qtype = (w if qtype is None else np.ascontiguousarray(w)), qtype
        self.blocked = None  # the way of a block table's rows, decided on its first block

    def rows(self, v0, v1):
        if self.qtype is not None and self.blocked is None:
            self.blocked = self._blocked_faster(v0, v1)
        self._take(v0, v1, bool(self.blocked) and self._blocks(v1 - v0))

    def _blocks(self, c):
        """whether oneDNN's kernels of both products of a ``c``-row block keep their
        weights in the layout gt_deq_tile_vnni writes"""
        T, D = self.T, self.D
        return bool(self.dnnl.primitive(Gemm(T, D, c, vnni=True))
                    and self.dnnl.primitive(Gemm(T, c, D, vnni=True)))

    def _take(self, v0, v1, blocked):
        c, D = v1 - v0, self.D
        self.c, self.vnni = c, blocked
        if self.qtype is None:
            self.wc16 = self.kern.buffer("head rows16", (c * D,), np.uint16)
            _f32_bf16(np.ascontiguousarray(self.w[v0:v1]), self.wc16, c * D)
            return
        w, lib, tid = self.w, qgemm.lib(), BLOCK_TYPES[self.qtype].id
        if not blocked:
            self.wc16 = self.kern.buffer("head rows16", (c * D,), np.uint16)
            qgemm.check(lib.gt_deq_tile_bf16(tid, w.ctypes.data, w.strides[0], None, v0, c,
                                             0, D, self.wc16.ctypes.data, D), "dequantize")
            return
        # K padded to 32 and N to 64 values (qgemm_tiles.bf16_scratch_elems)
        size = -(-c // 64) * 64 * -(-D // 32) * 32, -(-D // 64) * 64 * -(-c // 32) * 32
        self.wt16 = self.kern.buffer("head rows16 W^T", (size[0],), np.uint16)
        self.wn16 = self.kern.buffer("head rows16 W", (size[1],), np.uint16)
        for by_rows, out in ((1, self.wt16), (0, self.wn16)):
            qgemm.check(lib.gt_deq_tile_vnni(tid, w.ctypes.data, w.strides[0], v0, c, 0, D,
                                             by_rows, out.ctypes.data), "dequantize")

    def _blocked_faster(self, v0, v1):
        """``measure.fastest`` of the two ways on the block ``[v0, v1)``: its rows taken
        and both products, into scratch of their own (made only where no decision is
        cached)"""
        c = v1 - v0
        if not self._blocks(c):
            return False
        made = []

        def way(blocked):
            def run():
                if not made:
                    made.extend((np.empty((self.T, c), np.float32),
                                 np.empty((self.T, self.D), np.float32)))
                self._take(v0, v1, blocked)
                self.logits(made[0])
                self.weigh(made[0], made[1])
            return run
        blocked = measure.fastest(f"head {self.qtype}", (self.T, self.D, c),
                                  {"blocked": way(True), "plain": way(False)},
                                  self.kern.only) == "blocked"
        # the scratch of the way not taken (where both were timed) is not kept
        self.kern.release(*(("head rows16",) if blocked else
                            ("head rows16 W^T", "head rows16 W")))
        return blocked

    def logits(self, z):
        """z = x @ Wc^T (z contiguous, [T, c])"""
        assert z.flags.c_contiguous and z.shape == (self.T, self.c)
        if self.vnni:
            self.dnnl.gemm(Gemm(self.T, self.D, self.c, vnni=True), self.x16.ctypes.data,
                           self.wt16.ctypes.data, z.ctypes.data)
        else:
            self.dnnl.gemm(Gemm(self.T, self.D, self.c, True), self.x16.ctypes.data,
                           self.wc16.ctypes.data, z.ctypes.data)

    def weigh(self, z, out):
        """out = z @ Wc, z rounded to bf16"""
        assert z.flags.c_contiguous and out.flags.c_contiguous
        self.z16 = self.kern.buffer("head z16", (z.size,), np.uint16)
        qgemm.lib().gt_f32_bf16(z.ctypes.data, self.z16.ctypes.data, z.size)
        w16 = self.wn16 if self.vnni else self.wc16
        self.dnnl.gemm(Gemm(self.T, self.c, self.D, vnni=self.vnni), self.z16.ctypes.data,
                       w16.ctypes.data, out.ctypes.data)

    def table_grad(self, z, out):
        """out = z^T @ x ([c, D], rows contiguous), z rounded to bf16 (as
        ``backend._bf16_weight_grad`` says why)"""
        assert z.flags.c_contiguous and out.flags.c_contiguous
        self.z16 = self.kern.buffer("head z16", (z.size,), np.uint16)
        qgemm.lib().gt_f32_bf16(z.ctypes.data, self.z16.ctypes.data, z.size)
        self.dnnl.gemm(Gemm(self.c, self.T, self.D, ta=True), self.z16.ctypes.data,
                       self.x16.ctypes.data, out.ctypes.data)


class OnednnHeadGemms(tiled.HeadGemms):
    """``tiled.HeadGemms`` in oneDNN's float32 matmul, on OpenMP's threads as the C work
    between the products (NumPy's where oneDNN has no matmul for a block)."""

    def __init__(self, x, w, qtype, kern):
        super().__init__(x, w, qtype, kern)
        self.dnnl = onednn.library()

    def logits(self, z):
        if not self.dnnl.matmul_f32(z, self.x, self.wc.T):
            super().logits(z)

    def weigh(self, z, out):
        if not self.dnnl.matmul_f32(out, z, self.wc):
            super().weigh(z, out)

    def table_grad(self, z, out):
        if not self.dnnl.matmul_f32(out, z.T, self.x):
            super().table_grad(z, out)


TILED_OPS = ("head_nll", "head_nll_e", "head_nll_grad_x", "head_nll_grad_w", "head_rows",
             "attn", "attn_grad")
