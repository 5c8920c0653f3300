"""The CUDA backend: the compiled graph replayed on an NVIDIA GPU through CuPy.

Needs the optional extra: ``pip install 'gradtape[cuda]'`` (CuPy, ``cupy-cuda12x``) and a
GPU; without either, compiling with ``backend="cuda"`` raises ``devices.CudaUnavailable``
saying what is missing.

Lowering (the same passes as the cpu backend): ``compile.fuse`` groups elementwise chains
and last-axis reductions; ``codegen.py`` turns each group, reduction and data-movement op
into generated CUDA C, compiled once per program source with NVRTC (``cupy.RawModule``;
CuPy caches the binaries on disk by source).  Matmuls go to cuBLAS through our own handle
(``cublasGemmStridedBatchedEx``, loaded with ctypes; float32 with float32 compute, no
TF32; bfloat16 operands with float32 accumulation).

Memory: one arena (a single device allocation) per storage dtype.  ``arena.plan_arena``
lays out the liveness plan's buffers and then every leaf at aligned offsets; nothing is
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

The device layer (``devices.py``: ``CupyDevice``) is small: allocate, copy, launch a
kernel, call a GEMM, capture.  ``HarnessDevice`` implements it on the CPU, so the whole
lowering is tested without a GPU (``tests/backends/test_cuda_codegen.py``).
"""

from __future__ import annotations

import warnings

import numpy as np

from ... import settings
from ...compile.fuse import FusedGroup
from ..base import Backend
from . import codegen as G
from .arena import BF16_MIN_SIZE, from_storage, plan_arena, storage_codes, to_storage
from .devices import CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F, CupyDevice, RowMajorGemm


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

    def __init__(self, graph, schedule, plan, execution=None, storage=None, device=None,
                 bf16_min_size=BF16_MIN_SIZE):
        super().__init__(graph, schedule, plan, execution)
        for v in graph.ops:  # frozen weights in their stored type: cpu and numpy only
            if v.op in ("qmatmul", "qmatmul_t", "qtake_rows"):
                raise ValueError(f"backend 'cuda': no kernel for {v.op} #{v.index} (a weight "
                                 f"kept as {v.attrs['qtype']} blocks); load the model with "
                                 "float weights or use backend 'cpu'")
        storage = storage or self.default_storage or \
            settings.get("GRADTAPE_CUDA_STORAGE") or "float32"
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
        self._graph_failed = settings.get("GRADTAPE_CUDA_GRAPH") == "0"
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
        args = RowMajorGemm(m, n, k, batch, ta, tb, ptr[a], ptr[b], self._addr(s), sa, sb,
                            sc).cublas_args()
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

