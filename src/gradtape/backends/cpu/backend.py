"""The fast CPU backend: the compiled graph, fused and lowered to C and BLAS.

The compile passes it asks for (``passes``): ``merge_matmuls`` turns narrow matmuls that
share an operand (the LoRA ``x @ A`` of q/k/v, of gate/up, and their backward) into one
GEMM each, and k=1 outer products into fused multiplies; ``pair_loss_grads`` puts the
next-token loss's gradient right after the loss (where it does not depend on it), one
kernel writing both; ``fuse`` groups elementwise
chains (and chains feeding a last-axis sum / softmax / logsumexp) into FusedGroups, each a
generated C kernel (``codegen.py``), compiled once per distinct program source with the
system C compiler and cached on disk (``toolchain.py``).  Softmax and sums over the last
axis of any rank, the fused loss (``nll_ids``) and its gradient, transposes, broadcasts
and the data movement ops are C kernels too; row and elementwise loops split over the
cores (OpenMP) when big enough.  Matmuls write straight into their planned buffers: in
oneDNN's float32 matmul, on the same OpenMP threads, where the execution plan
says so (``plan.complete``: measured at the main matmul shape), else in NumPy's BLAS
(``np.matmul(..., out=)``); the remaining ops (gathers ...) run their NumPy forwards from
``ops/``, except a row scatter that only an add reads (a tied table's gradients), which
runs in that add's kernel (``codegen.scatter_add_body``).  Consecutive kernels between
two such ops run as one ctypes call.  Buffers come from
``plan_schedule_memory`` and are allocated once here: a replay allocates no
intermediates.

``compute="bf16"`` (float32 programs): matmuls against a big frozen weight (a float
const leaf) run in oneDNN with bf16 inputs and float32 accumulation (``onednn.py``); the
weight is converted to bf16 once (from any strides: a transposed weight gets no float32
copy) and reordered, per direction, into the layout oneDNN's kernel keeps its weights in
(``_Bf16Copies``), the activation operand by a C kernel in the batch before each such
GEMM, or by the fused group that computes it, which writes its rounding too
(``_act_writers``).  Products with a weight kept in its ggml blocks
(``qmatmul``, ``qmatmul_t``) do the same tile by tile, dequantizing straight into bf16
(``qgemm_bf16.lower_bf16``).  The fused attention's GEMMs take bf16 inputs too
(``csrc/flash.c``).  Where the plan says so (``trained_bf16``: full fine-tuning), a
trained weight (a float param) is read in bf16 the same way: the largest one from a copy
that its update kernel writes beside the new weight (``_Trained16``: no conversion pass),
each other one rounded into one shared scratch just before its products
(``_resident_trained``: a copy of one weight's size, not the model's), and its
gradient ``x^T dY`` takes bf16 inputs too (``_bf16_weight_grad``; a fused head's trained table:
``tiled.Bf16HeadGemms.table_grad``).  Everything else stays float32.  ``compute="int8"``
is bf16's, except that the block-weight products take int8 inputs, each row of the
activation and each row (forward) or column (backward) of W with its own scale, summed
in int32 (``qgemm_int8.lower_int8``): up to twice bf16's rate, at the cost of the
quantization's error, where the CPU has int8 dot products (AVX512-VNNI, AMX-INT8);
elsewhere oneDNN's int8 sums saturate, so it runs bf16's and says so once.

Without a working C compiler (``$GRADTAPE_CC`` names it, default ``cc``) ``unavailable``
says so and ``backends.get_backend`` gives the NumPy reference backend instead (one
RuntimeWarning).  Leaf storage and state updates are ``base.HostBackend``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import warnings
import weakref

import numpy as np

from ...compile.fuse import FusedGroup, loss_pairs, scatter_adds
from ...compile.memplan import views_in_place
from ...ops import PRIMS, _mT, inner_dim
from ..base import HostBackend, page_aligned
from ..lowering import C_ELEMENTWISE
from . import (codegen, measure, mkl, narrow, onednn, qgemm, qgemm_bf16, qgemm_int8, split,
               tiled, toolchain)
from .blas import one_blas_thread
from .qgemm_bf16 import Bf16Scratch
from .qgemm_int8 import Int8Scratch
from .qgemm_tiles import bf16_eligible

_LIBS = {}  # path -> loaded CDLL (one load per process)
# weight leaf -> its _Bf16Copies, shared by the programs of a tape that were not fed it
_SHARED_COPIES = weakref.WeakKeyDictionary()
# block-weight leaf -> its resident bf16 copy (uint16 [rows, k]), shared like the above
_RESIDENT = weakref.WeakKeyDictionary()
# trained weight leaf -> its _Trained16, shared by a step and its eval program: only the
# largest trained weight keeps one (``_resident_trained``); every other is converted into
# one shared scratch just before the products that read it
_TRAINED16 = weakref.WeakKeyDictionary()
# a weight packed into a GEMM kernel's own layout costs a second bf16 copy (one for x W,
# one for dY W^T); all packs of the process stay within this share of the machine's memory
PACK_SHARE = 0.125
# a weight that is not C-contiguous float32 is converted to bf16 a band of rows at a time
# through a float32 scratch of at most this many bytes
CONVERT_BAND = 4 << 20


class _Trained16:
    """The one bf16 copy (``array``: uint16, C order) of a trained weight, and ``src``: the
    float32 array whose current values it holds rounded (None: none).  The step's update
    kernel writes the copy with the new weight (``codegen.lower_elementwise``'s ``bf16``),
    so a step converts nothing; a program whose weight array is not ``src`` (a feed,
    ``--resume``, the first replay, an update that did not write it) converts it at the
    head of its replay."""

    __slots__ = ("array", "src")

    def __init__(self, shape, size):
        self.array = page_aligned(size, np.uint16).reshape(shape)
        self.src = None


class _Bf16Copies:
    """The bf16 copies of one frozen weight the GEMMs read: in its stored layout
    (``plain``, kept only where some GEMM reads it so), and reordered once into the layout
    oneDNN's kernel for a product keeps its weights in (``packs``: ``(tb, md, array,
    (m, k, n))``), so no call reorders it again (where that is faster:
    ``measure.packed_weights``)."""

    def __init__(self):
        self.plain, self.packs = None, []

    def arrays(self):
        return ([self.plain] if self.plain is not None else []) + [p[2] for p in self.packs]


def _packed_bytes():
    return sum(a.nbytes for w in list(_SHARED_COPIES.values()) for _, _, a, _ in w.packs)


def _resident_trained(weights):
    """The trained weights (of a program whose trained weights take bf16) that keep a bf16
    copy from step to step, written by their update (``_Trained16``): the largest one
    only (a tied embedding), which a scratch would have to be as big as.  Each other one
    is converted into a scratch as big as the largest of them just before its products
    (``x W``, ``dY W^T``, a recomputed layer's), once for consecutive ones: a step then
    holds a copy of one weight's size, not of the whole model's, for a conversion per use
    instead of one per step (docs/benchmarks.md: full fine-tuning's row)."""
    return {max(weights, key=lambda w: w.size)} if weights else set()


def _fusible_for(dtype):
    def fusible(v):
        return v.op in C_ELEMENTWISE and v.dtype == dtype
    return fusible


def _load(path):
    lib = _LIBS.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.gt_run.restype = None
        lib.gt_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        _LIBS[path] = lib
    return lib


def _mm_step(out, a, b, ta=False, tb=False):
    return functools.partial(np.matmul, _mT(a, ta), _mT(b, tb), out=out)


def _bf16_matmul(v, trained=False):
    """A matmul whose right operand is a big frozen weight (a float const leaf), or with
    ``trained`` a big trained one (a param): the GEMMs that ``compute="bf16"`` runs with
    bf16 inputs (``x @ W0``, ``dY @ W0^T``, the LM head and its transpose)."""
    if v.op != "matmul" or v.ndim != 2 or v.attrs.get("ta"):
        return False
    b = v.inputs[1]
    return (b.op == "const" or trained and b.op == "param") and b.size >= BF16_MIN_WEIGHT \
        and v.dtype == np.float32


def _bf16_weight_grad(v):
    """A trained weight's gradient ``dW = x^T dY`` (a 2-d matmul transposing its left
    operand, as big as a bf16 weight), in a program whose trained weights take bf16.

    It runs with bf16 inputs and float32 sums, as under torch's autocast: it is a third of
    a full step's GEMM work, which float32 would run at a fraction of bf16's rate (the
    plan chose bf16 by measuring so); rounding x and dY by at most 2^-9 each is the error
    the forward and dX products already carry, and AdamW divides each gradient by its own
    running scale, so no weight's update is lost to it (``tests/backends/
    test_bf16_compute.py`` gates the gradients' cosine)."""
    return (v.op == "matmul" and v.ndim == 2 and bool(v.attrs.get("ta"))
            and not v.attrs.get("tb") and v.size >= BF16_MIN_WEIGHT
            and v.dtype == np.float32)


BF16_MIN_WEIGHT = 1 << 16  # elements: smaller GEMMs gain nothing from a conversion pass
FUSED_K = 16  # the widest inner dimension of a product computed inside its readers' kernel


def _fused_product(v):
    """A 2-d product of at most ``FUSED_K`` terms per element, at least a vector of 8
    columns wide, whose right operand (copied onto the stack where transposed) is
    smaller than a bf16 weight: LoRA's ``(x A) B`` and ``(g B^T) A^T`` at ranks up to 16,
    computed where the fusion pass puts their readers (``codegen._product_sum``), never
    written as ``[T, n]``."""
    if v.op != "matmul" or v.ndim != 2 or v.shape[1] < 8:
        return False
    a, b = v.inputs
    return inner_dim(v) <= FUSED_K and b.size < BF16_MIN_WEIGHT and a.dtype == b.dtype == v.dtype


def _float_dtype(graph):
    """The one float dtype of the graph's ops, or None where there are several (a program
    that mixes them runs unfused, every op on its own)."""
    dtypes = {v.dtype for v in graph.ops}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


class CpuBackend(HostBackend):
    name = "cpu"
    passes = ("merge_matmuls", "pair_loss_grads", "fuse")
    fallback = "numpy"  # without a C compiler

    @classmethod
    def fusion(cls, graph):
        dtype = _float_dtype(graph)
        return {"fusible": _fusible_for(dtype) if dtype else (lambda v: False),
                "reductions": dtype is not None,
                "products": _fused_product if dtype else None}

    @classmethod
    def fuses_scatter_add(cls, graph):
        return _float_dtype(graph) is not None  # as ``_scatter_adds`` runs them

    @classmethod
    def unavailable(cls):
        try:
            toolchain.compiler()
        except toolchain.CompilerMissing as e:
            return str(e)
        return None

    def __init__(self, graph, schedule, plan, execution=None, arena=None):
        super().__init__(graph, schedule, plan, execution, arena)
        self.dtype = dtype = _float_dtype(graph)
        compute = execution.compute.value if execution is not None else "float32"
        # the ways of a block-weight product the plan leaves to be timed, and whether it
        # leaves room for a resident bf16 copy of each block weight
        self._only = ((execution.product_ways, execution.product_tile)
                      if execution is not None else ((), ""))
        self._resident_ok = bool(execution is not None and execution.resident_weights.value)
        self._resident = {}  # block-weight leaf -> its resident bf16 copy, once made
        # kernels: one translation unit for the program
        src = codegen.ProgramSource()
        block_ops = [s for s in schedule.steps if not isinstance(s, FusedGroup)
                     and s.op in qgemm.QOPS]
        # dense matmul -> the kernel converting its activation to bf16 (low precision)
        self._dense_bf16 = {}
        # a trained weight's gradient -> the kernels converting its two operands to bf16
        self._grad_bf16 = {}
        # trained weight leaf -> its _Trained16 (the bf16 copy its products read)
        self._trained16 = {}
        # trained weight leaf -> the kernel converting it into self._w16 before a product
        self._scratch16 = {}
        # the block-weight products that run with bf16 and with int8 inputs
        self._block_bf16, self._block_int8 = set(), set()
        # whether trained weights take bf16 as the frozen ones (the plan's trained_bf16)
        self._trained_ok = bool(execution is not None and execution.trained_bf16.value)
        if compute in ("bf16", "int8") and dtype == np.float32:
            self._take_low_precision(compute, src, block_ops, self._trained_ok)
        # update group -> the trained weights' copies it writes, and their leaves
        self._writes16, self._written16 = self._copy_writers()
        # group -> the activation whose bf16 rounding it writes into _act16 as well
        self._act_writer = self._act_writers()
        self._kernel_of = {g: src.kernel(g, dtype, self._bf16_members(g))
                           for g in schedule.groups}
        # one-add group -> (the row scatter only it reads, its other input, scratch)
        self._scatter_add = self._scatter_adds() if dtype is not None else {}
        for g, (sc, _, _) in self._scatter_add.items():
            self._kernel_of[g] = src.scatter_add_kernel(g, sc, dtype)
        for s in schedule.steps:  # data movement: block copies in C as well
            if not isinstance(s, FusedGroup) and codegen.c_single_op(s) and dtype is not None:
                self._kernel_of[s] = src.copy_kernel(s, dtype)
        # loss gradient -> its loss, both written by one pass over the logits
        self._loss_pair = loss_pairs(schedule) if dtype is not None else {}
        for d in self._loss_pair:
            self._kernel_of[d] = src.loss_grad_kernel(d, dtype)
        # the leaves this program updates without writing their bf16 copy (checked at
        # each replay: a later program may make a copy of one)
        self._unwritten = [w for w, _ in graph.updates
                           if w not in self._written16 and w.size >= BF16_MIN_WEIGHT]
        # the column scales of the block weights int8 GEMMs read transposed (weight leaf
        # -> qgemm_int8.col_scales' pair), computed on their first use
        self._col_scales_of = {}
        # frozen weights in their stored type: one float scratch tile, allocated once here
        block_ops = [s for s in block_ops
                     if s not in self._block_bf16 and s not in self._block_int8]
        self._f32_dnnl, self.f32_why = self._f32_gemms(execution)
        self._split_bound = False  # a GEMM bound to split.py (replay_context)
        self._tile_scratch = np.empty(max(1, qgemm.scratch_elems(block_ops)),
                                      dtype or np.float32) if block_ops else None
        self.n_kernels = len(src.bodies)
        self.lib = None
        self.cache_hit = None
        if self._kernel_of or self._dense_bf16 or self._grad_bf16:
            path, self.cache_hit = toolchain.build(src.source(),
                                                   flags=toolchain.threads_flags())
            self.lib = _load(path)
        self._weight_copies = {}  # weight leaf -> its _Bf16Copies
        self._step_weight16 = {}  # bf16 step -> (the copy of its weight it reads, packed?)
        self._dense_gemms = {}  # bf16 step -> its bound oneDNN call
        self._ctiles = {}  # (dtype, bf16) -> tiled.CTiles (_tiled_kernels)
        # programs of one tape (a training step and its eval) share the copies of a
        # weight none of them was fed (copy on feed, in set_leaf)
        for s in self._dense_bf16:
            w = s.inputs[1]
            if w in self._trained16:
                self._step_weight16[s] = (self._trained16[w].array, False)
            elif w in self._scratch16:
                self._step_weight16[s] = (self._w16[:w.size].reshape(w.shape), False)
            elif w not in self._weight_copies:
                self._weight_copies[w] = _SHARED_COPIES.setdefault(w, _Bf16Copies())
        self._copy_weights([s for s in self._dense_bf16 if s.inputs[1] not in self._trained16
                            and s.inputs[1] not in self._scratch16])
        self._bind()

    def _take_low_precision(self, compute, src, block_ops, trained=False):
        """Which GEMMs of a float32 program take bf16 or int8 inputs, and their scratch.
        A dense one's activation is converted by a kernel in the batch before it into
        one shared buffer (GEMMs run one at a time); its weight is converted once
        (``_copy_weights``).  Block-weight products convert both operands themselves
        (``qgemm_bf16``, ``qgemm_int8``), into scratch of their own.  ``trained``: the
        products with trained weights and their gradients take bf16 too; the largest
        such weight has one bf16 copy (``_Trained16``), written by its update kernel
        (``_copy_writers``) or converted at the head of a replay (``_refresh16``); the
        others are converted into one scratch before their products
        (``_resident_trained``)."""
        try:
            self._dnnl = onednn.dnnl()
        except onednn.DnnlError as e:
            warnings.warn(f"gradtape: {compute} compute asked for, running float32: {e}",
                          RuntimeWarning, stacklevel=6)
            return
        steps = [s for s in self.schedule.steps
                 if not isinstance(s, FusedGroup) and _bf16_matmul(s, trained)]
        self._dense_bf16 = {s: src.bf16_kernel(s.inputs[0].size) for s in steps}
        if steps:  # the bf16 copy of a dense GEMM's activation
            self._act16 = page_aligned(max(s.inputs[0].size for s in steps), np.uint16)
        trained = list(dict.fromkeys(s.inputs[1] for s in steps if s.inputs[1].op == "param"))
        resident = _resident_trained(trained)
        for w in trained:
            if w not in resident:
                self._scratch16[w] = src.bf16_kernel(w.size)
                continue
            if w not in _TRAINED16:
                _TRAINED16[w] = _Trained16(w.shape, w.size)
            self._trained16[w] = _TRAINED16[w]
        if self._scratch16:
            self._w16 = page_aligned(max(w.size for w in self._scratch16), np.uint16)
        grads = [s for s in self.schedule.steps if trained and not isinstance(s, FusedGroup)
                 and _bf16_weight_grad(s)]
        self._grad_bf16 = {s: tuple(src.bf16_kernel(x.size) for x in s.inputs) for s in grads}
        if grads:  # the bf16 copies of a weight gradient's x and dY
            self._gx16, self._gy16 = (
                page_aligned(max(s.inputs[i].size for s in grads), np.uint16) for i in (0, 1))
        self._block_bf16 = {s for s in block_ops if bf16_eligible(s)}
        # int8 compute: the block-weight GEMMs whose sums fit int32 take int8, where the
        # CPU has int8 dot products (else oneDNN's int8 sums saturate: bf16 instead)
        if compute == "int8":
            dots, why = measure.int8_dots()
            if not dots:
                measure.warn_once(f"int8 compute asked for, running bf16: {why}")
            else:
                self._block_int8 = {s for s in self._block_bf16
                                    if qgemm_int8.int8_eligible(s)}
                self._block_bf16 -= self._block_int8
        if self._block_bf16:
            self._bf16_scratch = Bf16Scratch.allocate(self._block_bf16)
            self._plain_gemms = self._bf16_provider()
        if self._block_int8:
            self._int8_scratch = Int8Scratch.allocate(self._block_int8)
        if self._dense_bf16 or self._grad_bf16 or self._block_bf16 or self._block_int8:
            self.compute = "int8" if self._block_int8 else "bf16"

    def _copy_writers(self):
        """``({update group: [trained weights whose bf16 copy it writes]}, their set)``: a
        trained weight's new value written in place (nothing reads the old one after it)
        by an elementwise group writes its bf16 rounding into the copy too, so the next
        replay's products read it without a conversion pass over every weight."""
        writes = {}
        if not self._trained16:
            return writes, set()
        group_of = {m: g for g in self.schedule.groups if g.kind == "elementwise"
                    for m in g.outputs}
        for w in self._trained16:
            g = group_of.get(self._in_place.get(w))
            if g is not None:
                writes.setdefault(g, []).append(w)
        return writes, {w for ws in writes.values() for w in ws}

    def _act_writers(self):
        """``{elementwise group: activation}``: a group producing the activation that the
        next bf16 GEMM rounds into ``_act16`` writes that rounding itself, so the GEMM
        converts nothing (the same bits: ``gt_bf16``).  Not across a weight gradient,
        which may read the dY its ``dY W^T`` left in ``_act16`` (``_bind_steps``)."""
        if not self._dense_bf16:
            return {}
        out, pending = {}, {}  # pending: output -> its group, since the last GEMM
        for s in self.schedule.steps:
            if isinstance(s, FusedGroup):
                if s.kind == "elementwise":
                    pending.update(dict.fromkeys(s.outputs, s))
            elif s in self._dense_bf16 or s in self._grad_bf16:
                g = pending.get(s.inputs[0]) if s in self._dense_bf16 else None
                if g is not None:
                    out[g] = s.inputs[0]
                pending = {}
        return out

    def _scatter_adds(self):
        """``{group: (scatter, b, scratch)}``: each ``compile.fuse.scatter_adds`` pair runs
        ``codegen.scatter_add_body`` instead of both ops (the scatter's zeros never
        written nor read again; the plan gave it its add's region)."""
        out = {}
        for g, (sc, b) in scatter_adds(self.schedule).items():
            n, d = sc.inputs[0].shape
            out[g] = (sc, b, (np.empty((max(n, 1), d), self.dtype),
                              np.empty(max(n, 1), np.int64)))
        return out

    def _bf16_members(self, g):
        """The members of group ``g`` whose bf16 rounding its kernel writes too, in the
        order of their pointers after its outputs (``_bind_steps``)."""
        return tuple([self._in_place[w] for w in self._writes16.get(g, ())]
                     + ([self._act_writer[g]] if g in self._act_writer else []))

    def _refresh16(self):
        """Convert each trained weight's bf16 copy this program reads whose values are not
        its weight's current ones (``_Trained16.src``)."""
        for w, rec in self._trained16.items():
            a = self._values[w]
            if rec.src is not a:
                self._convert(w, rec.array)
                rec.src = a

    def _bf16_provider(self):
        """The library the plan's ``bf16_gemms`` names for the plain bf16 GEMMs of block
        products: ``mkl.Mkl``, or None for oneDNN (also, with a warning, where MKL was
        named and cannot run here)."""
        named = self.execution is not None and self.execution.bf16_gemms.value == "mkl"
        if not named:
            return None
        try:
            return mkl.mkl()
        except mkl.MklError as e:
            warnings.warn(f"gradtape: the plan names MKL for the bf16 GEMMs, running "
                          f"oneDNN's: {e}", RuntimeWarning, stacklevel=7)
            said = self.execution.bf16_gemms  # the plan records what runs
            self.execution = self.execution.replace(bf16_gemms=type(said)("onednn", str(e)))
            return None

    def _f32_gemms(self, execution):
        """``(in oneDNN, why)`` for the float32 matmuls of a float32 program, as the plan
        says (``plan.complete``: oneDNN, one thread pool with our kernels, where measured
        fast enough; else NumPy's BLAS).  A bf16 program runs them in oneDNN where it can
        (``_matmul_step``)."""
        if self.low_precision or self.dtype != np.float32 or execution is None \
                or execution.f32_gemms is None:
            return False, ""
        return execution.f32_gemms.value == "onednn", execution.f32_gemms.why

    def _convert(self, leaf, out=None):
        """The bf16 copy (uint16, C order, ``leaf``'s shape) of a float weight of any
        strides: a C-contiguous one converted in one call, any other a band of rows at a
        time through a float32 scratch of at most ``CONVERT_BAND`` bytes, so a transposed
        weight never costs a whole float32 copy (rounding is per element: the same
        values whatever the layout)."""
        w = self._values[leaf]
        out = np.empty(leaf.shape, np.uint16) if out is None else out
        if w.dtype == np.float32 and w.flags.c_contiguous:
            self._to_bf16(w, out)
            return out
        rows = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(1, -1)
        dst = out.reshape(rows.shape)
        band = max(1, CONVERT_BAND // (4 * rows.shape[1]))
        scratch = np.empty((min(band, rows.shape[0]), rows.shape[1]), np.float32)
        for i in range(0, rows.shape[0], band):
            part = scratch[:min(band, rows.shape[0] - i)]
            np.copyto(part, rows[i:i + band], casting="same_kind")
            self._to_bf16(part, dst[i:i + band])
        return out

    def _to_bf16(self, x, out):
        """C-contiguous float32 ``x`` rounded into the C-contiguous uint16 ``out``."""
        self.lib.gt_to_bf16(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                            ctypes.c_long(x.size))

    def _copy_weights(self, steps):
        """Each bf16 step's copy of its weight (``self._step_weight16``): a pack in its
        kernel's layout where one exists, is faster than the plain copy read in place
        (``measure.packed_weights``) and fits in ``PACK_SHARE`` of the machine's memory,
        else the plain copy; both made from the weight's value now, one weight at a time
        (a plain copy converted only to be packed is dropped before the next)."""
        budget = PACK_SHARE * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        groups = {}
        for s in steps:
            groups.setdefault(s.inputs[1], []).append(s)
        for w, group in groups.items():
            copies = self._weight_copies[w]
            plain = copies.plain
            for s in group:
                tb = bool(s.attrs.get("tb"))
                (m, k), n = s.inputs[0].shape, s.shape[1]
                hit = next((a for t, md, a, _ in copies.packs
                            if t == tb and self._dnnl.same_layout(md, m, k, n)), None)
                if (hit is None and _packed_bytes() + 2 * w.size <= budget
                        and measure.packed_weights(m, k, n, tb, self._only)):
                    plain = self._convert(w) if plain is None else plain
                    try:
                        hit, md = self._dnnl.pack(m, k, n, tb, plain)
                    except onednn.DnnlError:  # no reorder into that layout: plain copy
                        hit = None
                    if hit is not None:
                        copies.packs.append((tb, md, hit, (m, k, n)))
                packed = hit is not None
                if not packed:
                    plain = self._convert(w) if plain is None else plain
                    copies.plain = hit = plain
                self._step_weight16[s] = (hit, packed)

    def _arena_moved(self):
        super()._arena_moved()
        self._dense_gemms.clear()  # oneDNN calls bound to the old buffer's outputs

    def bf16_weights(self):
        """The bf16 weight copies this program reads (for the memory estimate)."""
        return ([a for w in self._weight_copies.values() for a in w.arrays()]
                + list(self._resident.values()) + [r.array for r in self._trained16.values()])

    def _resident_copy(self, leaf, qtype, k):
        """The block weight ``leaf`` dequantized once into bf16 (uint16 ``[rows, k]``, its
        tiles' very values), shared by the programs of its tape that were not fed it."""
        if leaf not in self._resident:
            copy = _RESIDENT.get(leaf)
            if copy is None:
                copy = _RESIDENT[leaf] = qgemm.deq_rows_bf16(self._values[leaf], qtype, k)
            self._resident[leaf] = copy
        return self._resident[leaf]

    def _tiled_kernels(self, dtype, bf16):
        """This program's ``tiled.CTiles`` for ``dtype``: the scratch the fused head
        keeps from step to step lives as long as the program (or its ``SharedArena``:
        one for all the programs drawing from it)."""
        key = (np.dtype(dtype).str, bf16)
        if key not in self._ctiles:
            trained = bf16 and self._trained_ok
            make = functools.partial(tiled.CTiles, dtype, bf16, self._f32_dnnl, self._only,
                                     trained_bf16=trained)
            # one for the programs sharing an arena (they never run at once)
            self._ctiles[key] = make() if self._arena is None else self._arena.kept(
                ("CTiles", *key, self._f32_dnnl, repr(self._only), trained), make)
        return self._ctiles[key]

    # --- binding ---------------------------------------------------------------------
    def _bind_steps(self, val):
        # C kernels read raw pointers: every float leaf they read must be C-contiguous.
        # A bf16 GEMM's frozen weight is not one of them: its kernels read its bf16
        # copy, converted from any strides (``_convert``), so a transposed weight (a
        # Hugging Face [out, in] tensor seen as [in, out]) gets no float32 copy here.
        for x in self._raw_leaves():
            if not val[x].flags.c_contiguous:
                self._own(x)
        batch = _KernelBatch()
        steps = []  # ("py", callable) or ("c", first call, calls): the replay, in order
        # the activations whose bf16 copies self._act16 and the block products' scratch hold
        last_act16 = last_block_x = None
        last_gx = None  # the weight gradient's x whose bf16 copy self._gx16 holds
        last_w16 = None  # the trained weight whose bf16 copy self._w16 holds
        fused_scatters = {sc for sc, _, _ in self._scatter_add.values()}
        paired_losses = set(self._loss_pair.values())  # written by their gradient's kernel
        for s in self.schedule.steps:
            if views_in_place(s, val) or s in fused_scatters or s in paired_losses:
                continue  # nothing to run
            if s in self._scatter_add:  # b + scatter_rows(src, ids) in one kernel
                sc, b, (acc, first) = self._scatter_add[s]
                batch.add(s, self._kernel_of[s], [val[x].ctypes.data for x in
                                                  (b, *sc.inputs, s.outputs[0])]
                          + [acc.ctypes.data, first.ctypes.data])
                continue
            if s in self._grad_bf16:  # x and dY converted in the batch, then oneDNN
                x, dy = s.inputs
                kx, ky = self._grad_bf16[s]
                # q, k, v (gate, up) gradients read one x: rounded once while it lasts
                if x is not last_gx:
                    batch.add(s, kx, (val[x].ctypes.data, self._gx16.ctypes.data))
                    last_gx = x
                # dY W^T, just before, left dY rounded in _act16: read there
                dy16 = self._act16 if dy is last_act16 else self._gy16
                if dy16 is self._gy16:
                    batch.add(s, ky, (val[dy].ctypes.data, dy16.ctypes.data))
                batch.flush(steps)
                steps.append(("py", self._grad_gemm(s, val, dy16)))
                continue
            if s in self._dense_bf16:  # convert op(a) in the batch, then one oneDNN call
                a = s.inputs[0]
                # q, k, v (gate, up) read one x: rounded once while the copy lasts (only
                # these conversions and _act_writer's groups write _act16; a, read
                # here, is still live)
                if a is not last_act16:
                    batch.add(s, self._dense_bf16[s], (val[a].ctypes.data,
                                                       self._act16.ctypes.data))
                    last_act16 = a
                # a trained weight without a copy of its own, rounded into the scratch
                # (once for consecutive products: its update runs after its last reader)
                w = s.inputs[1]
                if w in self._scratch16 and w is not last_w16:
                    batch.add(w, self._scratch16[w], (val[w].ctypes.data,
                                                      self._w16.ctypes.data))
                    last_w16 = w
                batch.flush(steps)
                steps.append(("py", self._dense_gemm(s, val)))
                continue
            if s in self._kernel_of:
                outs = s.outputs if isinstance(s, FusedGroup) else (s,)
                if s in self._loss_pair:  # the loss, written from the same pass
                    outs += (self._loss_pair[s],)
                batch.add(s, self._kernel_of[s], [val[x].ctypes.data for x in s.inputs]
                          + [val[m].ctypes.data for m in outs]
                          + [self._trained16[w].array.ctypes.data
                             for w in self._writes16.get(s, ())]
                          + ([self._act16.ctypes.data] if s in self._act_writer else []))
                if s in self._act_writer:  # the next bf16 GEMM's activation, rounded
                    last_act16 = self._act_writer[s]
                continue
            batch.flush(steps)
            if s in self._block_bf16:
                # q, k, v (gate, up) of block weights read one x: rounded by the first
                # (a forward product writes the scratch's act only there; a backward
                # one, anew)
                x = s.inputs[0] if s.op == "qmatmul" else None
                steps.append(("py", self._host_step(s, val, rounded=x is not None
                                                    and x is last_block_x)))
                last_block_x = x
            else:
                steps.append(("py", self._host_step(s, val)))
        batch.flush(steps)
        self._ptrs, self._calls, self._call_owners = batch.tables()
        base = self._calls.ctypes.data
        return [rest[0] if kind == "py" else
                functools.partial(self.lib.gt_run, ctypes.addressof(self._ptrs),
                                  base + 8 * rest[0], rest[1])
                for kind, *rest in steps]

    def _raw_leaves(self):
        """The leaves a C kernel of the batch reads by raw pointer: a fused group's or a
        lone op's inputs, a bf16 GEMM's activation, both operands of a weight gradient in
        bf16."""
        read = [x for g in list(self._kernel_of) + list(self._grad_bf16) for x in g.inputs]
        read += [s.inputs[0] for s in self._dense_bf16] + list(self._scratch16)
        read += [x for sc, _, _ in self._scatter_add.values() for x in sc.inputs]
        return [x for x in dict.fromkeys(read) if x.is_leaf]

    def _dense_gemm(self, s, val):
        """The oneDNN call of bf16 step ``s`` (bound once: its operands stay in place)."""
        if s not in self._dense_gemms:
            a = s.inputs[0]
            a16 = self._act16[:a.size].reshape(a.shape)
            w16, packed = self._step_weight16[s]
            self._dense_gemms[s] = self._dnnl.bind(val[s], a16, w16, bool(s.attrs.get("tb")),
                                                   packed)
        return self._dense_gemms[s]

    def _grad_gemm(self, s, val, dy16):
        """The oneDNN call of a trained weight's gradient ``s`` (``x^T dY``: x ``[k, m]``
        and dY ``[k, n]`` read from their bf16 copies, dY's in ``dy16``), bound once."""
        if s not in self._dense_gemms:
            (k, m), n = s.inputs[0].shape, s.shape[1]
            run = self._dnnl.bind_ptrs(onednn.Gemm(m, k, n, ta=True), self._gx16.ctypes.data,
                                       dy16.ctypes.data, val[s].ctypes.data)
            run.keep = (self._gx16, dy16, val[s])
            self._dense_gemms[s] = run
        return self._dense_gemms[s]

    def _host_step(self, s, val, rounded=False):
        """The callable running step ``s`` outside the kernel batch: a matmul, a
        block-weight product, a tiled primitive with its C kernels, or the op's NumPy
        forward."""
        ins = tuple(val[x] for x in s.inputs)
        if s.op == "matmul":
            return self._matmul_step(val[s], *ins, **s.attrs)
        if s in self._block_int8:
            leaf, a = s.inputs[1], s.attrs
            columns = functools.partial(self._col_scales, leaf, a["qtype"], a["rows"],
                                        a["k"])
            return qgemm_int8.lower_int8(s, val[s], ins, self._dnnl, self._int8_scratch,
                                         columns, functools.partial(measure.blocked_faster,
                                                                    only=self._only))
        if s in self._block_bf16:
            resident = (functools.partial(self._resident_copy, s.inputs[1], s.attrs["qtype"],
                                          s.attrs["k"]) if self._resident_ok else None)
            return qgemm_bf16.lower_bf16(s, val[s], ins, self._dnnl, self._bf16_scratch,
                                         functools.partial(measure.fastest, only=self._only),
                                         rounded=rounded, resident=resident,
                                         plain_gemms=self._plain_gemms)
        if s.op in qgemm.QOPS:
            return qgemm.lower(s, val[s], ins, self._tile_scratch)
        if s.op in tiled.TILED_OPS:  # the blocks' elementwise work in C
            bf16 = self.low_precision and not s.attrs.get("f32")  # ops.attn's f32
            kern = self._tiled_kernels(s.dtype, bf16)
            return functools.partial(PRIMS[s.op].forward, val[s], *ins, kern=kern, **s.attrs)
        return functools.partial(PRIMS[s.op].forward, val[s], *ins, **s.attrs)

    def kernel_calls(self):
        """Each generated-kernel call of the bound replay, in order: ``(schedule step (a
        trained weight for its conversion), label, callable running that call alone)``;
        the label names a bf16 GEMM's activation or trained weight's conversion, a fused
        group's kind, domain and ops, or a lone op (a profile's: ``bench/profile_step.py
        --kernels``)."""
        base, ptrs = self._calls.ctypes.data, ctypes.addressof(self._ptrs)
        out = []
        for i, s in enumerate(self._call_owners):
            if s in self._dense_bf16:
                label = f"bf16 conversion {list(s.inputs[0].shape)}"
            elif s in self._grad_bf16:
                label = f"bf16 conversion for x^T dY {list(s.shape)}"
            elif s in self._scratch16:
                label = f"bf16 conversion of a trained weight {list(s.shape)}"
            elif isinstance(s, FusedGroup):
                label = f"{s.kind} {list(s.domain)} [{','.join(v.op for v in s.ops)}]"
            else:
                label = f"{s.op} {list(s.shape)}"
            out.append((s, label, functools.partial(self.lib.gt_run, ptrs, base + 8 * i, 1)))
        return out

    def _matmul_step(self, out, a, b, ta=False, tb=False):
        """A float32 matmul: in a bf16 program, and in a float32 one that measured it
        fast (``_f32_gemms``), through oneDNN where it can (its threads are the OpenMP
        threads the bf16 GEMMs and our kernels use; in a bf16 replay NumPy's BLAS is kept
        on one thread, see ``_execute``), or, for one with a side of at most
        ``narrow.NARROW`` (LoRA's rank-r products), through ``narrow.py``'s loops where
        measured faster at its shape (``measure.narrow_way``), and in a float32 program
        one that NumPy's BLAS split over the OpenMP threads runs faster
        (``measure.split_way``) through ``split.py``; else NumPy's BLAS."""
        if self.low_precision or self._f32_dnnl:
            a, b = _mT(a, ta), _mT(b, tb)
            way = (measure.narrow_way(a, b) if a.ndim == b.ndim == 2 and a.dtype == np.float32
                   and narrow.form(*a.shape, b.shape[1]) else "onednn")
            if way != "onednn":  # a rank-r product: our loops, measured faster
                run = narrow.bind(out, a, b, threaded=way == "narrow")
                if run is not None:
                    return run
            if (self._f32_dnnl and a.ndim == b.ndim == 2 and a.dtype == np.float32
                    and measure.split_way(a, b) == "split"):
                run = split.bind(out, a, b)  # OpenBLAS's kernels, measured faster here
                if run is not None:
                    self._split_bound = True  # the replay keeps NumPy's BLAS on one thread
                    return run
            run = onednn.library().bind_f32(out, a, b)
            if run is not None:
                return run
            return _mm_step(out, a, b)
        return _mm_step(out, a, b, ta, tb)

    def scratch_bytes(self):
        """Bytes of the block-weight products' scratch: float tiles, and the bf16 and int8
        operands and products (for the memory estimate)."""
        arrays = [self._tile_scratch]
        if self._block_bf16:
            arrays += self._bf16_scratch.arrays()
        if self._block_int8:
            arrays += self._int8_scratch.arrays()
        if self._grad_bf16:
            arrays += [self._gx16, self._gy16]
        if self._scratch16:
            arrays.append(self._w16)
        return sum(a.nbytes for a in arrays if a is not None)

    def _col_scales(self, leaf, qtype, rows, k):
        """``qgemm_int8.col_scales`` of the block weight ``leaf``, computed once per value"""
        if leaf not in self._col_scales_of:
            self._col_scales_of[leaf] = qgemm_int8.col_scales(self._values[leaf], qtype, rows,
                                                              k)
        return self._col_scales_of[leaf]

    @property
    def low_precision(self):
        """Whether the frozen-weight GEMMs take bf16 or int8 inputs (oneDNN, on OpenMP's
        threads)."""
        return self.compute in ("bf16", "int8")

    def set_leaf(self, leaf, arr):
        super().set_leaf(leaf, arr)
        self._col_scales_of.pop(leaf, None)
        if leaf in self._trained16:  # new values: converted before the next replay
            self._trained16[leaf].src = None
        if leaf in self._resident:  # a fed block weight: a copy of this program's own
            if self._resident[leaf] is _RESIDENT.get(leaf):
                self._resident[leaf] = np.empty_like(self._resident[leaf])
                self._stale = True  # its products bound again to the new copy
            a = leaf.attrs
            np.copyto(self._resident[leaf],
                      qgemm.deq_rows_bf16(self._values[leaf], a["qtype"], a["logical"][1]))
        if leaf not in self._weight_copies:
            return
        # a fed weight: this program's own bf16 copies from now on, refreshed on each feed
        copies = self._weight_copies[leaf]
        if copies is _SHARED_COPIES.get(leaf):
            self._weight_copies[leaf] = _Bf16Copies()
            self._copy_weights([s for s in self._dense_bf16 if s.inputs[1] is leaf])
            self._dense_gemms.clear()
            self._stale = True  # bound again before the next replay
            return
        w16 = self._convert(leaf, copies.plain)
        for tb, _, a, (m, k, n) in copies.packs:
            self._dnnl.pack(m, k, n, tb, w16, out=a)

    # --- replay ------------------------------------------------------------------------
    def _execute(self):
        self._refresh16()
        with self.replay_context():
            super()._execute()
        for w in self._written16:  # its update kernel wrote the copy with the new values
            self._trained16[w].src = self._values[w]
        for w in self._unwritten:  # updated (now or after this) without its copy
            rec = _TRAINED16.get(w)
            if rec is not None:
                rec.src = None

    @contextlib.contextmanager
    def replay_context(self):
        """What a replay's steps run inside (and a profile timing them one by one): a bf16
        replay, and a float32 one with a GEMM bound to ``split.py`` (a single-threaded
        BLAS call on each OpenMP thread), runs on OpenMP's threads (oneDNN, our kernels),
        so NumPy's BLAS, for any float32 GEMM oneDNN did not take, stays on one thread
        (``blas.one_blas_thread``); a float32 one flushes denormals
        (``_flushing_denormals``)."""
        one_pool = self.low_precision or self._split_bound
        with one_blas_thread() if one_pool else contextlib.nullcontext(), \
                self._flushing_denormals():
            yield

    @contextlib.contextmanager
    def _flushing_denormals(self):
        """A float32 replay with denormals flushed to zero (``codegen.DENORMALS``), the
        caller's mode back after it; float64 programs, the exact reference, are left as
        they are."""
        if self.dtype != np.float32 or self.lib is None:
            yield
            return
        old = self.lib.gt_denormals(1)
        try:
            yield
        finally:
            if old == 0:
                self.lib.gt_denormals(0)


class _KernelBatch:
    """The generated-kernel calls of a replay: consecutive ones run as one ``gt_run``
    call over a table of ``(kernel, offset into the pointer table)`` pairs."""

    def __init__(self):
        self.ptrs, self.calls = [], []
        self.pending = []  # calls not yet flushed into a gt_run step: (kernel, offset)
        self.owners = []  # the schedule step of each call, in the order of calls

    def add(self, step, kernel, ptrs):
        """A call of ``kernel`` on ``ptrs`` (its inputs, then its outputs) for ``step``."""
        self.pending.append((kernel, len(self.ptrs)))
        self.ptrs.extend(ptrs)
        self.owners.append(step)

    def flush(self, steps):
        """Append the pending calls to ``steps`` as one ``("c", first call, calls)``."""
        if self.pending:
            steps.append(("c", len(self.calls) // 2, len(self.pending)))
            self.calls.extend(x for call in self.pending for x in call)
            self.pending.clear()

    def tables(self):
        """``(pointer table, call table, owners)`` for ``gt_run``."""
        return ((ctypes.c_void_p * max(len(self.ptrs), 1))(*self.ptrs),
                np.array(self.calls or [0], dtype=np.int32), self.owners)
