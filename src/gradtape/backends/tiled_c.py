"""The cpu backend's kernels for the tiled primitives' elementwise work (``tiled.py``):
the same methods as ``tiled.NumpyTiles``, one C loop over a block's rows each (OpenMP
over the rows; ``csrc/tiled.c``), so a block of scores is read and written once per step
instead of once per NumPy call.  The GEMMs and the walk over the blocks are ``tiled.py``'s
own.

Math as in ``NumpyTiles``, in the block's dtype (row sums as ``csrc/tiled.c`` says);
float32 ``exp`` is ``_cgen``'s vectorizable ``gt_expf``; masked entries are exactly 0.  Without a C compiler
the cpu backend runs on NumPy anyway (``CpuBackend.unavailable``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _cgen, qgemm

_LIB = []


def _lib():
    if not _LIB:
        path, _ = _cgen.build_csrc(["flash.c"], flags=_cgen.threads_flags(), prefix="tiled")
        _LIB.append(ctypes.CDLL(str(path)))
    return _LIB[0]


def _p(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


_L, _D = ctypes.c_long, ctypes.c_double


class CTiles:
    """``tiled.NumpyTiles``' methods as C loops, for one float dtype."""

    def __init__(self, dtype):
        self.suf = "f32" if np.dtype(dtype) == np.float32 else "f64"
        lib = _lib()
        self.f = {name: getattr(lib, f"gt_{name}_{self.suf}")
                  for name in ("head_fwd", "head_dz", "attn_fwd", "attn_p", "attn_ds")}
        for fn in self.f.values():
            fn.restype = None
        self.flash = ((lib.gt_flash_fwd_f32, lib.gt_flash_bwd_f32) if self.suf == "f32"
                      else None)
        self.lanes = lib.gt_flash_lanes()  # of the GEMM blocks' vectors (0: plain C)

    def fused_attn(self, out, q, k, v, lay, *, gy=None, y=None, nh, nkv, hd, iscale, cap,
                   window):
        """The whole of ``tiled.fwd_attn`` (``gy`` None) or ``fwd_attn_grad`` as one
        call of ``csrc/flash.c``; False where it does not apply (float64, segment ids
        that are not contiguous runs: the walk of ``tiled.py`` runs them)."""
        if self.flash is None or (lay.seg is not None and lay.starts is None):
            return False
        qgemm.park_blas_threads()  # or they poll on the cores the call's threads need
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        starts = None if lay.starts is None else np.ascontiguousarray(lay.starts, np.int64)
        dims = (_L(lay.n_seq), _L(q.shape[0]), _L(k.shape[0]), _L(nh), _L(nkv), _L(hd),
                _D(iscale), _D(cap), _L(window))
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


TILED_OPS = ("head_nll", "head_nll_e", "head_nll_grad_x", "head_nll_grad_w", "attn",
             "attn_grad")
_KERNELS = {}


def kernels(dtype):
    """The CTiles of ``dtype`` (built once per process)."""
    key = np.dtype(dtype).str
    if key not in _KERNELS:
        _KERNELS[key] = CTiles(dtype)
    return _KERNELS[key]
