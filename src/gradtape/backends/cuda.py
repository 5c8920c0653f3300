"""The CUDA backend: the compiled graph replayed on an NVIDIA GPU through CuPy.

Needs the optional extra: ``pip install 'gradtape[cuda]'`` (CuPy, ``cupy-cuda12x``) and a
GPU; without either, compiling with ``backend="cuda"`` raises ``CudaUnavailable`` saying
what is missing.

Lowering (the same passes as the cpu backend): ``compile.fuse`` groups elementwise chains
and last-axis reductions; ``_cudagen`` turns each group, reduction and data-movement op
into generated CUDA C, compiled once per program source with NVRTC (``cupy.RawModule``;
CuPy caches the binaries on disk by source).  Matmuls go to cuBLAS through our own handle
(``cublasGemmStridedBatchedEx``, loaded with ctypes; float32 with float32 compute, no
TF32; bfloat16 operands with float32 accumulation).

Memory: one arena (a single device allocation) per storage dtype.  ``plan_arena`` lays
out the liveness plan's buffers and then every leaf at aligned offsets; nothing is
allocated per step.  Leaves (weights, adapter params, optimizer moments) are uploaded once
and stay on the device; a run copies in only the leaves it is fed and copies out only the
outputs; state updates are device-to-device copies.

Storage ``"bfloat16"`` (``backend="cuda-bf16"``, or ``$GRADTAPE_CUDA_STORAGE=bfloat16``,
or ``CudaBackend(graph, plan, storage="bfloat16")``) keeps a float32 tape but stores large
values as bfloat16: every float value of at least ``bf16_min_size`` elements (65536) that
is not an output, a state leaf or an update source.  So frozen weights and activations
are bf16 while adapter params, moments, gradients of small params and scalars stay
float32 (an AdamW step of 1e-4 relative is below bf16's resolution).  Kernels compute in
float32.

Replay: the first run launches its steps one by one (eager).  The second run captures
forward + backward + update into a CUDA graph on the backend's stream and every later run
relaunches it; fed leaves are first copied into their fixed arena slots, so the captured
graph stays valid.  If capture fails the backend says so once (a RuntimeWarning) and keeps
launching eagerly (``$GRADTAPE_CUDA_GRAPH=0`` turns capture off).

The device layer (``CupyDevice``) is small: allocate, copy, launch a kernel, call a GEMM,
capture.  ``HarnessDevice`` implements it on the CPU with the kernels compiled as C by the
system compiler and a GEMM that follows cuBLAS's column-major contract, so the whole
lowering is tested without a GPU (``tests/backends/test_cuda_codegen.py``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError
from ..compile.fuse import FusedGroup, step_inputs, step_outputs
from ..compile.memplan import plan_liveness
from . import _cudagen as G
from .base import Backend

ALIGN = 256  # bytes; every buffer in an arena starts on this boundary
BF16_MIN_SIZE = 65536
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


# --- storage and arena planning ---------------------------------------------------------

def storage_codes(graph, schedule, storage="float32", bf16_min_size=BF16_MIN_SIZE):
    """Var -> storage code for every leaf and every value that leaves a step."""
    if storage not in ("float32", "bfloat16"):
        raise ValueError(f"cuda backend: storage must be 'float32' or 'bfloat16', got "
                         f"{storage!r}")
    keep32 = set(graph.outputs) | {leaf for leaf, _ in graph.updates} | \
        {src for _, src in graph.updates}
    values = list(graph.leaves)
    for s in schedule.steps:
        values += list(step_outputs(s))
    codes = {}
    for v in values:
        dt = np.dtype(v.dtype)
        if dt == np.float32:
            big = v.size >= bf16_min_size and v not in keep32 and v.op != "scatter_rows"
            codes[v] = "bf16" if storage == "bfloat16" and big else "float32"
        elif dt == np.float64:
            if storage == "bfloat16":
                raise ValueError("cuda backend: bfloat16 storage needs a float32 tape")
            codes[v] = "float64"
        elif dt in (np.int64, np.int32):
            codes[v] = str(dt)
        else:
            raise ValueError(f"cuda backend: values of dtype {dt} are not supported "
                             f"({v.op} #{v.index})")
    return codes


class _Val:
    """A stand-in Var for the liveness planner: the value's size in its storage dtype."""
    __slots__ = ("var", "size", "dtype")

    def __init__(self, var, code):
        self.var, self.size = var, var.size
        self.dtype = np.dtype(G.STORAGE_NPTYPE[code])


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Arena:
    nbytes: dict  # storage code -> total bytes of that arena
    loc: dict  # Var -> (storage code, byte offset)
    buffers: tuple  # (code, offset, nbytes) per planned (shared) buffer, then per leaf
    plan: object  # the MemoryPlan of intermediates (in storage dtypes)
    extra: dict  # name -> (code, offset, nbytes): snapshots and scratch


def plan_arena(graph, schedule, codes, extra=()) -> Arena:
    """Lay out the liveness plan of the schedule's values (in their storage dtypes) and
    then one slot per leaf and per ``extra`` request ``(name, code, nbytes)``, each at
    an ALIGN-aligned offset of its dtype's arena."""
    vals = {}

    def val(v):
        p = vals.get(v)
        if p is None:
            p = vals[v] = _Val(v, codes[v])
        return p

    steps = [(tuple(val(x) for x in step_inputs(s) if not x.is_leaf),
              tuple(val(m) for m in step_outputs(s))) for s in schedule.steps]
    pinned = {val(v) for v in graph.outputs if not v.is_leaf} | \
        {val(src) for _, src in graph.updates if not src.is_leaf}
    plan = plan_liveness(steps, pinned)
    code_of = {}
    for p, b in plan.slot.items():
        code_of[b] = codes[p.var]
    nbytes, buf_off, buffers = {}, {}, []
    for b, (dt, n) in enumerate(plan.buffer_sizes):
        c = code_of[b]
        off = nbytes.get(c, 0)
        size = max(n, 1) * dt.itemsize
        buf_off[b] = off
        buffers.append((c, off, size))
        nbytes[c] = off + _align(size)
    # a planner may place several values in one buffer (element offsets in plan.offset)
    offset = getattr(plan, "offset", None) or {}
    loc = {p.var: (codes[p.var], buf_off[b] + offset.get(p, 0) * p.dtype.itemsize)
           for p, b in plan.slot.items()}
    for leaf in graph.leaves:
        c = codes[leaf]
        off = nbytes.get(c, 0)
        size = max(leaf.size, 1) * np.dtype(G.STORAGE_NPTYPE[c]).itemsize
        loc[leaf] = (c, off)
        buffers.append((c, off, size))
        nbytes[c] = off + _align(size)
    ex = {}
    for name, c, size in extra:
        off = nbytes.get(c, 0)
        ex[name] = (c, off, size)
        nbytes[c] = off + _align(max(size, 1))
    return Arena(nbytes=nbytes, loc=loc, buffers=tuple(buffers), plan=plan, extra=ex)


# --- host-side bfloat16 conversion (the same rounding as gt_f2bf) --------------------------

def f32_to_bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), out)
    return out.astype(np.uint16)


def bf16_bits_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_storage(arr, code):
    if code == "bf16":
        return f32_to_bf16_bits(arr)
    return np.ascontiguousarray(arr, dtype=G.STORAGE_NPTYPE[code])


def from_storage(raw, code, dtype, shape):
    if code == "bf16":
        raw = bf16_bits_to_f32(raw)
    return np.asarray(raw).astype(dtype, copy=False).reshape(shape)


# --- cuBLAS through ctypes ----------------------------------------------------------------

CUDA_R_32F, CUDA_R_64F, CUDA_R_16BF = 0, 1, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUDA_TYPE = {"float32": CUDA_R_32F, "float64": CUDA_R_64F, "bf16": CUDA_R_16BF}


def gemm_args(m, n, k, batch, ta, tb, a, b, c, sa, sb, sc):
    """The row-major product C[m, n] = op(A) op(B) (per batch) as cuBLAS's column-major
    call: cuBLAS sees each row-major matrix transposed, so it computes
    C^T[n, m] = op(B)^T op(A)^T.  Returns the argument tuple of
    ``cublasGemmStridedBatchedEx`` after ``handle`` and before ``alpha``/``beta`` are
    spliced in: (transa, transb, m', n', k', A', typeA, lda, strideA, B', typeB, ldb,
    strideB, C, typeC, ldc, strideC, batch)."""
    opb, ldb = (CUBLAS_OP_T, k) if tb else (CUBLAS_OP_N, n)
    opa, lda = (CUBLAS_OP_T, m) if ta else (CUBLAS_OP_N, k)
    return (opb, opa, n, m, k, b, CUDA_TYPE[sb], ldb, k * n, a, CUDA_TYPE[sa], lda, m * k,
            c, CUDA_TYPE[sc], n, m * n, batch)


def _find_cublas():
    """A path (or soname) of libcublas: $GRADTAPE_CUBLAS, the copy CuPy already loaded,
    the nvidia-cublas-cu12 wheel, the CUDA toolkit."""
    env = os.environ.get("GRADTAPE_CUBLAS")
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
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
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
        """A callable running one GEMM: ``args`` from ``gemm_args``."""
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
    compiled as C (``_cudagen.HARNESS_PRELUDE``: pthread blocks and barriers), and a GEMM
    that follows cuBLAS's column-major contract, so ``gemm_args`` is exercised too.
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


# --- the backend --------------------------------------------------------------------------

class CudaBackend(Backend):
    """``compile.lower(graph, CudaBackend, storage=None, device=None,
    bf16_min_size=65536)``: device memory of its own (``Arena``), so none of the host
    storage of ``base.HostBackend``."""

    name = "cuda"
    passes = ("fuse",)
    default_storage = None

    @classmethod
    def fusion(cls, graph):
        return {"fusible": G.fusible, "reductions": True}

    def __init__(self, graph, schedule, plan, compute="float32", storage=None, device=None,
                 bf16_min_size=BF16_MIN_SIZE):
        super().__init__(graph, schedule, plan, compute)
        for v in graph.ops:  # frozen weights in their stored type: cpu and numpy only
            if v.op in ("qmatmul", "qmatmul_t", "qtake_rows"):
                raise ValueError(f"backend 'cuda': no kernel for {v.op} #{v.index} (a weight "
                                 f"kept as {v.attrs['qtype']} blocks); load the model with "
                                 "float weights or use backend 'cpu'")
        storage = storage or self.default_storage or \
            os.environ.get("GRADTAPE_CUDA_STORAGE", "float32")
        self.storage = storage
        self.device = dev = device if device is not None else CupyDevice()
        self.codes = codes = storage_codes(graph, self.schedule, storage, bf16_min_size)
        steps = list(self.schedule.steps)
        # snapshots: update sources that are themselves updated leaves, and outputs that
        # are updated leaves (an output is the value before the update, as on numpy)
        targets = {leaf for leaf, _ in graph.updates}
        itemsize = lambda v: np.dtype(G.STORAGE_NPTYPE[codes[v]]).itemsize  # noqa: E731
        extra = []
        for i, (leaf, src) in enumerate(graph.updates):
            if src in targets:
                extra.append((f"snap{i}", codes[src], src.size * itemsize(src)))
        for i, v in enumerate(graph.outputs):
            if v in targets:
                extra.append((f"out{i}", codes[v], v.size * itemsize(v)))
        # matmul operands converted to bf16 when the other side is bf16
        src = G.ProgramSource()
        mm_plan = []
        for s in steps:
            if not isinstance(s, FusedGroup) and s.op == "matmul":
                kinds = self._mm_types(s)
                for x, want in zip(s.inputs, kinds[:2]):
                    if codes[x] != want:
                        extra.append((f"cast{s.index}_{x.index}", want, x.size * 2))
                mm_plan.append(s)
        self.arena = arena = plan_arena(graph, self.schedule, codes, extra)
        self.plan = arena.plan
        self._base = {c: dev.alloc(n) for c, n in arena.nbytes.items()}
        # kernels
        self._kernel_of = {}
        for s in steps:
            k = self._lower(s)
            if k is not None:
                self._kernel_of[s] = k
        self._cast_kernels = {}
        for s in mm_plan:
            for x, want in zip(s.inputs, self._mm_types(s)[:2]):
                if codes[x] != want:
                    self._cast_kernels[(s, x)] = G.cast_kernel(codes[x], want, x.size)
        self._zero_kernels = {s: G.zero_kernel(codes[s], s.size) for s in steps
                              if not isinstance(s, FusedGroup) and s.op == "scatter_rows"}
        self._kidx = {}
        for obj, k in list(self._kernel_of.items()) + list(self._cast_kernels.items()) + \
                [((s, "zero"), k) for s, k in self._zero_kernels.items()]:
            self._kidx[obj] = src.add(k)
        self.n_kernels = len(src.kernels)
        self.source = src
        if src.kernels:
            dev.load(src)
        # leaves: uploaded once
        for leaf in graph.leaves:
            self._upload(leaf, leaf._value)
        self._steps = self._bind(steps)
        self._graph_launch = None
        self._graph_failed = os.environ.get("GRADTAPE_CUDA_GRAPH", "1") == "0"
        self.graph_captured = False
        self._runs = 0

    # --- lowering ------------------------------------------------------------------------
    def _mm_types(self, s):
        """(storage of A, of B, of C) as cuBLAS will see them."""
        c = self.codes
        a, b = s.inputs
        if s.dtype == np.float64:
            return ("float64", "float64", "float64")
        if "bf16" in (c[a], c[b], c[s]):
            return ("bf16", "bf16", c[s])
        return ("float32", "float32", "float32")

    def _lower(self, s):
        c = self.codes
        if isinstance(s, FusedGroup):
            return G.group_kernel(s, c)
        if s.op == "matmul":
            return None
        if G.fusible(s):  # an elementwise op left alone by the fusion pass
            return G.group_kernel(G.single_group(s), c)
        if s.op in G.REDUCE_OPS:  # any axes; last-axis ones not fused come here too
            return G.reduce_kernel(s, c)
        if s.op in G.GATHER_OPS:
            return G.gather_kernel(s, c)
        if s.op in G.NLL_OPS:
            return G.nll_kernel(s, c)
        if s.op == "scatter_rows":
            return G.scatter_add_kernel(s, c)
        raise ValueError(f"backend 'cuda': no kernel for primitive {s.op!r}")

    def _addr(self, v):
        code, off = self.arena.loc[v]
        return self._base[code] + off

    def _extra(self, name):
        code, off, _ = self.arena.extra[name]
        return self._base[code] + off

    def _launch_cfg(self, kernel):
        kind, n = kernel.launch
        dev = self.device
        if kind == "elem":
            block = dev.block_elem
            return min(max(1, -(-n // block)), dev.max_grid), block
        return min(max(1, n), dev.max_grid), dev.block_row

    def _bind(self, steps):
        dev, out = self.device, []
        for s in steps:
            if isinstance(s, FusedGroup):
                addrs = [self._addr(x) for x in s.inputs] + [self._addr(m) for m in s.outputs]
                k = self._kernel_of[s]
                out.append(dev.kernel(self._kidx[s], *self._launch_cfg(k), addrs))
            elif s.op == "matmul":
                out += self._bind_matmul(s)
            else:
                if s in self._zero_kernels:
                    zk = self._zero_kernels[s]
                    out.append(dev.kernel(self._kidx[(s, "zero")], *self._launch_cfg(zk),
                                          [self._addr(s)]))
                k = self._kernel_of[s]
                addrs = [self._addr(x) for x in s.inputs] + [self._addr(s)]
                out.append(dev.kernel(self._kidx[s], *self._launch_cfg(k), addrs))
        # state updates: snapshots first (simultaneous semantics), outputs that are
        # updated leaves, then the copies
        targets = {leaf for leaf, _ in self.graph.updates}
        nb = lambda v: v.size * np.dtype(G.STORAGE_NPTYPE[self.codes[v]]).itemsize  # noqa
        srcs = []
        for i, (leaf, src) in enumerate(self.graph.updates):
            if src in targets:
                out.append(dev.memcpy(self._extra(f"snap{i}"), self._addr(src), nb(src)))
                srcs.append(self._extra(f"snap{i}"))
            else:
                srcs.append(self._addr(src))
        self._out_addr = []
        for i, v in enumerate(self.graph.outputs):
            if v in targets:
                out.append(dev.memcpy(self._extra(f"out{i}"), self._addr(v), nb(v)))
                self._out_addr.append(self._extra(f"out{i}"))
            else:
                self._out_addr.append(self._addr(v))
        for (leaf, src), a in zip(self.graph.updates, srcs):
            if self.codes[leaf] != self.codes[src]:
                raise ValueError("cuda backend: update of a leaf from a value of another "
                                 "storage dtype")
            out.append(dev.memcpy(self._addr(leaf), a, nb(leaf)))
        return out

    def _bind_matmul(self, s):
        dev = self.device
        a, b = s.inputs
        ta, tb = s.attrs.get("ta", False), s.attrs.get("tb", False)
        sa, sb, sc = self._mm_types(s)
        steps, ptr = [], {}
        for x, want in ((a, sa), (b, sb)):
            if self.codes[x] != want:
                k = self._cast_kernels[(s, x)]
                dst = self._extra(f"cast{s.index}_{x.index}")
                steps.append(dev.kernel(self._kidx[(s, x)], *self._launch_cfg(k),
                                        [self._addr(x), dst]))
                ptr[x] = dst
            else:
                ptr[x] = self._addr(x)
        m, n = s.shape[-2:]
        k = a.shape[-2] if ta else a.shape[-1]
        batch = s.shape[0] if s.ndim == 3 else 1
        if m * n == 0:
            return steps
        if k == 0:
            raise ValueError(f"backend 'cuda': matmul #{s.index} has an empty inner dim")
        args = gemm_args(m, n, k, batch, ta, tb, ptr[a], ptr[b], self._addr(s), sa, sb, sc)
        compute = CUBLAS_COMPUTE_64F if sa == "float64" else CUBLAS_COMPUTE_32F
        steps.append(dev.gemm(args, compute, f"matmul #{s.index} {list(a.shape)} "
                                             f"{list(b.shape)}"))
        return steps

    # --- leaves --------------------------------------------------------------------------
    def _upload(self, leaf, arr):
        code = self.codes[leaf]
        self.device.upload(self._addr(leaf), to_storage(np.asarray(arr).reshape(-1), code))

    def set_leaf(self, leaf, arr):
        if leaf not in self.codes:
            return  # pruned: nothing reads this leaf
        self._upload(leaf, arr)

    def _download(self, addr, v):
        code = self.codes[v]
        npdt = G.STORAGE_NPTYPE[code]
        raw = self.device.download(addr, v.size * np.dtype(npdt).itemsize, npdt, v.size)
        return from_storage(raw, code, v.dtype, v.shape)

    def leaf_value(self, leaf):
        return self._download(self._addr(leaf), leaf)

    # --- replay --------------------------------------------------------------------------
    def run(self, arrays):
        for leaf, arr in arrays.items():
            self.set_leaf(leaf, arr)
        dev = self.device
        if self._graph_launch is not None:
            dev.launch_graph(self._graph_launch)
        elif self._runs >= 1 and not self._graph_failed and self._steps:
            try:
                self._graph_launch = dev.capture(self._steps)
                self.graph_captured = True
            except Exception as e:
                self._graph_failed = True
                warnings.warn(f"gradtape: backend 'cuda' could not capture the step as a "
                              f"CUDA graph ({type(e).__name__}: {str(e)[:200]}); launching "
                              "kernels one by one", RuntimeWarning, stacklevel=3)
                self._recover()
                dev.run(self._steps)
            else:
                dev.launch_graph(self._graph_launch)
        else:
            dev.run(self._steps)
        self._runs += 1
        return [self._download(a, v) for a, v in zip(self._out_addr, self.graph.outputs)]

    def _recover(self):
        """After a failed capture: make sure the stream is out of capture mode."""
        rt = getattr(self.device, "rt", None)
        if rt is None:
            return
        try:
            rt.streamEndCapture(self.device.stream.ptr)
        except Exception:
            pass
        try:
            self.device.sync()
        except Exception:
            pass


class CudaBf16Backend(CudaBackend):
    """``backend="cuda-bf16"``: the cuda backend with bfloat16 storage."""
    name = "cuda-bf16"
    default_storage = "bfloat16"
