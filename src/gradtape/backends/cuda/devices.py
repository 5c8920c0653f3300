"""The cuda backend's device layer: allocate, copy, launch a kernel, call a GEMM, capture.

``CupyDevice`` is the GPU: CuPy allocations and NVRTC kernels on one stream, and GEMMs
through our own cuBLAS handle (``Cublas``, loaded with ctypes: CuPy refuses cuBLAS calls
inside CUDA-graph capture, ours has its stream and workspace set before capture).
``RowMajorGemm`` turns a row-major product into cuBLAS's column-major call.
``HarnessDevice`` implements the same layer on the CPU, the generated kernels compiled as
C by the system compiler and a GEMM that follows cuBLAS's column-major contract, so the
whole lowering is tested without a GPU (``tests/backends/test_cuda_codegen.py``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

import numpy as np

from ... import settings
from ...errors import GradtapeError
from . import codegen as G
from .arena import ALIGN, bf16_bits_to_f32, f32_to_bf16_bits

INSTALL_HINT = "pip install 'gradtape[cuda]'  (installs CuPy: cupy-cuda12x)"


class CudaUnavailable(GradtapeError, RuntimeError):
    """The cuda backend cannot run here: CuPy is missing or there is no CUDA device (a
    ``GradtapeError``: the CLI says it in one line)."""


def require_cupy():
    """Import CuPy and check that a device is visible; raise ``CudaUnavailable`` with what
    to install or check otherwise."""
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailable(f"backend 'cuda' needs CuPy, which is not installed ({e}); "
                              f"install it with: {INSTALL_HINT}") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device
        raise CudaUnavailable(f"backend 'cuda': CuPy found no usable CUDA device ({e}); "
                              "check the NVIDIA driver and CUDA_VISIBLE_DEVICES") from None
    if n < 1:
        raise CudaUnavailable("backend 'cuda': no CUDA device is visible "
                              "(check the NVIDIA driver and CUDA_VISIBLE_DEVICES)")
    return cupy


# --- cuBLAS through ctypes ----------------------------------------------------------------

CUDA_R_32F, CUDA_R_64F, CUDA_R_16BF = 0, 1, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUDA_TYPE = {"float32": CUDA_R_32F, "float64": CUDA_R_64F, "bf16": CUDA_R_16BF}


@dataclass(frozen=True)
class RowMajorGemm:
    """The row-major product ``C[m, n] = op(A)[m, k] op(B)[k, n]`` (per batch, each
    operand contiguous) at device addresses ``a``, ``b``, ``c`` in the storage ``sa``,
    ``sb``, ``sc`` ("float32", "float64", "bf16")."""

    m: int
    n: int
    k: int
    batch: int
    ta: bool  # A stored [k, m]
    tb: bool  # B stored [n, k]
    a: int
    b: int
    c: int
    sa: str
    sb: str
    sc: str

    def cublas_args(self):
        """The product as cuBLAS's column-major call: cuBLAS sees each row-major matrix
        transposed, so it computes C^T[n, m] = op(B)^T op(A)^T.  The argument tuple of
        ``cublasGemmStridedBatchedEx`` after ``handle`` and before ``alpha``/``beta`` are
        spliced in: (transa, transb, m', n', k', A', typeA, lda, strideA, B', typeB, ldb,
        strideB, C, typeC, ldc, strideC, batch)."""
        m, n, k = self.m, self.n, self.k
        opb, ldb = (CUBLAS_OP_T, k) if self.tb else (CUBLAS_OP_N, n)
        opa, lda = (CUBLAS_OP_T, m) if self.ta else (CUBLAS_OP_N, k)
        return (opb, opa, n, m, k, self.b, CUDA_TYPE[self.sb], ldb, k * n, self.a,
                CUDA_TYPE[self.sa], lda, m * k, self.c, CUDA_TYPE[self.sc], n, m * n,
                self.batch)


def _find_cublas():
    """A path (or soname) of libcublas: $GRADTAPE_CUBLAS, the copy CuPy already loaded,
    the nvidia-cublas-cu12 wheel, the CUDA toolkit."""
    env = settings.get("GRADTAPE_CUBLAS")
    if env:
        return [env]
    cands = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "/libcublas.so" in p and p not in cands:
                    cands.append(p)
    except OSError:
        pass
    cands += ["libcublas.so.12", "libcublas.so"]
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "cublas", "lib", "libcublas.so*")))
    for root in (settings.get("CUDA_PATH"), settings.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            cands += sorted(glob.glob(os.path.join(root, "lib64", "libcublas.so*")))
    return cands


class Cublas:
    """Our own cuBLAS handle bound to one stream and workspace, so that GEMMs can be
    captured into a CUDA graph (CuPy's own cuBLAS calls refuse capture)."""

    def __init__(self, stream_ptr, workspace_ptr, workspace_bytes):
        try:  # make CuPy load its cuBLAS first, so /proc/self/maps names it
            import cupy.cuda.cublas  # noqa: F401
        except Exception:
            pass
        lib, errors = None, []
        for cand in _find_cublas():
            try:
                lib = ctypes.CDLL(cand)
                lib.cublasGemmStridedBatchedEx  # noqa: B018 - present in this library?
                break
            except (OSError, AttributeError) as e:
                errors.append(f"{cand}: {e}")
                lib = None
        if lib is None:
            raise CudaUnavailable("backend 'cuda': libcublas not found (set $GRADTAPE_CUBLAS "
                                  "to its path); tried: " + "; ".join(errors[:6]))
        self.lib = lib
        vp, ci, cll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasDestroy_v2.argtypes = [vp]
        f = lib.cublasGemmStridedBatchedEx
        f.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, cll, vp, ci, ci, cll, vp, vp, ci,
                      ci, cll, ci, ci, ci]
        f.restype = ci
        self._gemm = f
        h = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate_v2")
        self.handle = h
        self._check(lib.cublasSetStream_v2(h, vp(stream_ptr)), "cublasSetStream_v2")
        self._check(lib.cublasSetWorkspace_v2(h, vp(workspace_ptr), workspace_bytes),
                    "cublasSetWorkspace_v2")
        self._scalars = {}  # compute dtype -> (alpha, beta) ctypes values kept alive

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"backend 'cuda': {what} failed with cuBLAS status {status}")

    def call(self, args, compute, what):
        """A callable running one GEMM: ``args`` from ``RowMajorGemm.cublas_args``."""
        if compute not in self._scalars:
            ct = ctypes.c_double if compute == CUBLAS_COMPUTE_64F else ctypes.c_float
            self._scalars[compute] = (ct(1.0), ct(0.0))
        alpha, beta = self._scalars[compute]
        (ta, tb, m, n, k, A, tA, lda, sA, B, tB, ldb, sB, C, tC, ldc, sC, batch) = args
        full = (self.handle, ta, tb, m, n, k, ctypes.addressof(alpha), A, tA, lda, sA, B, tB,
                ldb, sB, ctypes.addressof(beta), C, tC, ldc, sC, batch, compute,
                CUBLAS_GEMM_DEFAULT)
        fn, check = self._gemm, self._check

        def run():
            check(fn(*full), f"cublasGemmStridedBatchedEx ({what})")
        return run


# --- devices ------------------------------------------------------------------------------

class CupyDevice:
    """The real device: CuPy allocations, NVRTC kernels, our cuBLAS handle, one stream."""

    block_elem, block_row, max_grid = 256, 256, 65535 * 16
    WORKSPACE = 32 << 20  # cuBLAS workspace (NVIDIA's recommendation for Hopper)

    _shared = None  # (stream, workspace, Cublas): one per process, shared by programs

    def __init__(self):
        cp = require_cupy()
        self.cp = cp
        self.rt = cp.cuda.runtime
        self._mem = []
        if CupyDevice._shared is None:
            stream = cp.cuda.Stream(non_blocking=True)
            ws = cp.cuda.alloc(self.WORKSPACE)
            CupyDevice._shared = (stream, ws, Cublas(stream.ptr, ws.ptr, self.WORKSPACE))
        self.stream, _, self.cublas = CupyDevice._shared
        self._funcs = None

    def alloc(self, nbytes):
        mem = self.cp.cuda.alloc(max(int(nbytes), ALIGN))
        self._mem.append(mem)
        return mem.ptr

    def upload(self, addr, host):
        host = np.ascontiguousarray(host)
        self.rt.memcpyAsync(addr, host.ctypes.data, host.nbytes, 1, self.stream.ptr)

    def download(self, addr, nbytes, npdtype, count):
        out = np.empty(count, npdtype)
        self.rt.memcpyAsync(out.ctypes.data, addr, nbytes, 2, self.stream.ptr)
        self.stream.synchronize()
        return out

    _modules = {}  # source hash -> RawModule: one NVRTC compile per distinct source

    def load(self, src: G.ProgramSource):
        text = src.cuda_source()
        self.source = text
        key = G.source_hash(text)
        mod = CupyDevice._modules.get(key)
        if mod is None:
            mod = CupyDevice._modules[key] = self.cp.RawModule(code=text,
                                                               options=("--std=c++14",))
        try:
            self._funcs = [mod.get_function(nm) for nm in src.names()]
        except Exception as e:  # NVRTC errors carry the log
            raise RuntimeError(f"backend 'cuda': NVRTC failed on the generated kernels: "
                               f"{e}") from e

    def kernel(self, k, grid, block, addrs):
        f = self._funcs[k]
        args = tuple(np.uint64(a) for a in addrs)
        return lambda: f((grid,), (block,), args)

    def memcpy(self, dst, src, nbytes):
        rt, s = self.rt, self.stream
        return lambda: rt.memcpyAsync(dst, src, nbytes, 3, s.ptr)

    def gemm(self, args, compute, what):
        return self.cublas.call(args, compute, what)

    def run(self, steps):
        with self.stream:
            for s in steps:
                s()

    def capture(self, steps):
        """Capture ``steps`` into a CUDA graph on the stream; return its launcher."""
        s, rt = self.stream, self.rt
        mode = getattr(rt, "streamCaptureModeRelaxed", 2)
        with s:
            if hasattr(s, "begin_capture"):
                try:
                    s.begin_capture(mode=mode)
                except TypeError:
                    s.begin_capture()
                try:
                    for st in steps:
                        st()
                finally:
                    graph = s.end_capture()
                return lambda: graph.launch(s)
            rt.streamBeginCapture(s.ptr, mode)
            try:
                for st in steps:
                    st()
            finally:
                g = rt.streamEndCapture(s.ptr)
            ex = rt.graphInstantiate(g)
            return lambda: rt.graphLaunch(ex, s.ptr)

    def launch_graph(self, launcher):
        with self.stream:
            launcher()

    def sync(self):
        self.stream.synchronize()


def _cm_view(addr, npdtype, rows, cols, ld, batch, stride):
    """A column-major ``rows x cols`` matrix (leading dim ``ld``) per batch at ``addr``."""
    it = np.dtype(npdtype).itemsize
    n = (batch - 1) * stride + (cols - 1) * ld + rows if rows and cols else 1
    buf = (ctypes.c_char * (n * it)).from_address(addr)
    flat = np.frombuffer(buf, dtype=npdtype)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols),
                                           (stride * it, it, ld * it), writeable=True)


_CUDA_NP = {CUDA_R_32F: np.float32, CUDA_R_64F: np.float64, CUDA_R_16BF: np.uint16}


class HarnessDevice:
    """The device layer on the CPU, for tests: numpy-backed arenas, the generated kernels
    compiled as C (``codegen.HARNESS_PRELUDE``: pthread blocks and barriers), and a GEMM
    that follows cuBLAS's column-major contract, so ``RowMajorGemm`` is exercised too.
    Small blocks and grids make the grid-stride loops and tree reductions do real work."""

    def __init__(self, block_elem=8, block_row=4, max_grid=3, cache=None,
                 capture_fails=False):
        self.block_elem, self.block_row, self.max_grid = block_elem, block_row, max_grid
        self.cache = cache
        self.capture_fails = capture_fails
        self._mem = []
        self.launches = 0

    def alloc(self, nbytes):
        a = np.zeros(max(int(nbytes), ALIGN) + ALIGN, np.uint8)
        self._mem.append(a)
        base = a.ctypes.data
        return base + (-base) % ALIGN

    def upload(self, addr, host):
        host = np.ascontiguousarray(host)
        ctypes.memmove(addr, host.ctypes.data, host.nbytes)

    def download(self, addr, nbytes, npdtype, count):
        out = np.empty(count, npdtype)
        ctypes.memmove(out.ctypes.data, addr, nbytes)
        return out

    def load(self, src: G.ProgramSource):
        self.source = src.cuda_source()
        path = G.build_harness(src.harness_source(), self.cache)
        self.lib = ctypes.CDLL(str(path))
        self._funcs = []
        for nm in src.names():
            f = getattr(self.lib, "launch_" + nm)
            f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            f.restype = None
            self._funcs.append(f)

    def kernel(self, k, grid, block, addrs):
        f = self._funcs[k]
        P = (ctypes.c_void_p * max(len(addrs), 1))(*addrs)

        def run():
            self.launches += 1
            f(P, grid, block)
        return run

    def memcpy(self, dst, src, nbytes):
        return lambda: ctypes.memmove(dst, src, nbytes)

    def gemm(self, args, compute, what):
        (ta, tb, m, n, k, A, tA, lda, sA, B, tB, ldb, sB, C, tC, ldc, sC, batch) = args
        acc = np.float64 if compute == CUBLAS_COMPUTE_64F else np.float32

        def operand(addr, typ, trans, rows, cols, ld, stride):
            # op(X) is rows x cols; X is stored rows x cols (N) or cols x rows (T)
            r, c = (cols, rows) if trans else (rows, cols)
            x = _cm_view(addr, _CUDA_NP[typ], r, c, ld, batch, stride)
            x = bf16_bits_to_f32(x) if typ == CUDA_R_16BF else x.astype(acc)
            return np.swapaxes(x, 1, 2) if trans else x

        def run():
            a = operand(A, tA, ta, m, k, lda, sA)
            b = operand(B, tB, tb, k, n, ldb, sB)
            c = np.matmul(a.astype(acc), b.astype(acc))
            out = _cm_view(C, _CUDA_NP[tC], m, n, ldc, batch, sC)
            out[...] = f32_to_bf16_bits(c) if tC == CUDA_R_16BF else c
        return run

    def run(self, steps):
        for s in steps:
            s()

    def capture(self, steps):
        if self.capture_fails:
            raise RuntimeError("harness: capture refused (test)")
        steps = list(steps)
        return lambda: self.run(steps)

    def launch_graph(self, launcher):
        launcher()

    def sync(self):
        pass
