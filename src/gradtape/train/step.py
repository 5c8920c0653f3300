"""Training: one step recorded once, replayed every step.

``TrainStep`` records, on one tape, the forward of a micro-batch through the model with
the adapter's params (LoRA's A and B; DoRA's magnitudes too: ``models.dora``), the
next-token loss over target ids, ``backward`` (which touches only the adapter: frozen
weights are consts and get no gradient), clipping by global norm and AdamW.  Full
fine-tuning (``fine_tune_type="full"``, ``train.full``) records the same graph with every
weight a param instead of a const and no adapter.  It compiles that into one Program whose
state (params, moments, and the gradient accumulator when ``grad_accum > 1``) lives in the
backend between steps.

A preference method (``train.methods``, a row whose data is ``preference``) records
``train.preference.record_preference`` in place of the next-token loss: one forward over
the ``2 * batch_size`` sequences of ``batch_size`` pairs; the step program also outputs
the method's metrics, the eval program the loss, the log-probabilities and the metrics.
With MPI each rank takes its share of every global micro-batch's pairs, its loss and
metrics weighted by ``1 / (grad_accum * ranks)``, so the Allreduce sums them (they ride
in the gradient vector) into the single-process run's.

Gradient accumulation: every micro-batch's loss weights are ``1 / N`` with ``N`` the
target-token count of the whole step, so the summed gradient is that of the mean over all
tokens (weighting by micro-batch would favour short ones).  Micro-batches add into an
accumulator; the last one of a step (``apply`` = 1) clips, updates and clears it.

Data-parallel (``world`` with more than one rank, see ``distributed``): the gradient must
be summed over ranks between backward and the update, so the same tape compiles into two
programs instead of one.  ``grads_program`` outputs ONE contiguous vector ``[P + 2]``:
every adapter gradient flattened, the (weighted) loss and a stop flag, accumulated over
micro-batches; one ``Allreduce`` sums it; ``update_program`` takes the sum as a fed leaf,
slices it back into gradients, clips and applies AdamW.  Each rank weights its tokens by
``1 / N`` with ``N`` the target-token count of the whole global step, so the sum is exactly
the single-process gradient.  The params live as state in ``update_program`` and are
copied into ``grads_program``'s leaves after every update.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import MutableMapping
from dataclasses import dataclass

import numpy as np

from .. import nn, ops
from ..optim import AdamWConfig, adamw, clip_by_global_norm, global_norm
from ..tape import Tape
from ..backends.base import SharedArena
from ..errors import GradtapeError
from ..models.attention_choice import attention_from
from ..models.dora import adapter_leaves, leaf_params
from ..models.graph import head_loss, record_forward, weight_consts
from ..models.memory import GiB, mem_available, resident_copy_bytes
from ..plan import (DEFAULT_COMPUTE, Decision, for_training, reference_pairs,
                    resident_weights)
from . import full
from .data import IGNORE, empty_rows
from .memory import planned
from .methods import Options, method as method_row
from .preference import pair_batch, record_base_logps, record_preference


@dataclass(frozen=True)
class Schedule:
    lr: float
    steps: int
    warmup: int = 0
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        """Learning rate of 0-based step ``step``: linear warmup, then cosine decay."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos)


class StateArrays(MutableMapping):
    """Named arrays read one at a time when asked (``read``: name -> a function making the
    array), so that a checkpoint of every weight and its moments never holds a second copy
    of the whole state; an array assigned is kept as given."""

    def __init__(self, read):
        self._read, self._set = dict(read), {}

    def __getitem__(self, name):
        return self._set[name] if name in self._set else self._read[name]()

    def __setitem__(self, name, value):
        self._set[name] = value

    def __delitem__(self, name):
        self._read.pop(name, None)
        self._set.pop(name, None)

    def __iter__(self):
        return iter(dict.fromkeys([*self._read, *self._set]))

    def __len__(self):
        return len(set(self._read) | set(self._set))


def _float32_state(program, leaf):
    return program.state(leaf).astype(np.float32, copy=False)


# --grad-checkpoint auto recomputes as few layers as keep the run (the step's plan, the
# eval program, the weights) within this share of the memory available; the rest stays
# for the machine's other work and the estimate's error.  Recomputing a layer costs about
# one more forward pass of it, so the fewer the better.
AUTO_SHARE = 0.75
# ... and as few as keep the activations within this share of the run even where it fits
# (a big model's preference pair: a third of its layers or so)
AUTO_ACTIVATIONS = 1 / 3
# ... and every layer where that is a good trade: it frees at least this share of the
# run's memory, at no more work than a GFLOP of recomputed products per
# AUTO_MB_PER_GFLOP MB freed: a small model's activations weigh much beside its products
# (recomputing pays), a big model's little (docs/benchmarks.md has the measured cases).
AUTO_FREES = 0.25
AUTO_MB_PER_GFLOP = 1.0
# ... or, where the trained values' state (params and AdamW's moments) is at least this
# share of the run (full fine-tuning: 12 bytes a weight), wherever it pays that much a
# GFLOP: the state is fixed, the activations are the one large part a choice can shed
AUTO_STATE = 0.5
# "fit" keeps only the first rule: as few layers as keep the run within AUTO_SHARE
GRAD_CHECKPOINT = ("auto", "fit", "on", "off")


# the ops that skip a row whose target id is negative (``ops.lm_head``): where only they
# read the targets, a row without one is fed -1 and costs none of the head's GEMMs
SKIPS_UNTARGETED = frozenset({"head_nll", "head_nll_e", "head_nll_grad_x",
                              "head_nll_grad_w", "head_rows"})


def no_target_id(targets, programs) -> int:
    """The id to feed ``targets`` (a leaf) on a row without a target: -1 where every op
    of ``programs`` reading it skips such rows, else 0 (the composed loss takes every
    row's id)."""
    readers = {v.op for p in programs for v in p.graph.ops if targets in v.inputs}
    return -1 if readers and readers <= SKIPS_UNTARGETED else 0


def recompute_pays(off, on) -> bool:
    """Whether recomputing every layer (``on``, a ``memory.Estimate``) rather than none
    (``off``) frees at least ``AUTO_MB_PER_GFLOP`` MB per GFLOP of products it adds and
    either ``AUTO_FREES`` of the run's memory or, in a run whose trained state is at
    least ``AUTO_STATE`` of it, anything at all."""
    freed, work = off.total - on.total, on.flops - off.flops
    share = freed >= AUTO_FREES * off.total or off.state >= AUTO_STATE * off.total
    return (freed > 0 and share
            and freed / 2**20 >= AUTO_MB_PER_GFLOP * max(work, 1) / 1e9)


class TrainStep:
    """The compiled training step (and an eval program on the same tape)."""

    def __init__(self, model, adapter, batch_size, seq_len, *, opt=AdamWConfig(), clip=1.0,
                 grad_accum=1, backend="numpy", dtype=np.float32, world=None,
                 compute=DEFAULT_COMPUTE, grad_checkpoint="off", memory_limit=None,
                 memory_hint=": use a shorter --seq-len or a smaller --batch-size (or "
                             "--ignore-memory to try anyway)", method="sft",
                 options=Options(), fine_tune_type="lora"):
        """``grad_checkpoint``: "on" recomputes each layer's forward in backward (keeping
        only the layers' input rows), "off" keeps the activations, "auto" recomputes every
        layer where that frees much memory for little work, or any beside a large trained
        state (``recompute_pays``), else the
        fewest (the first ones) that keep the activations within ``AUTO_ACTIVATIONS`` of
        the run and the run within ``AUTO_SHARE`` of ``memory_limit`` bytes (where
        given); "fit" only the fewest that keep the run within ``AUTO_SHARE`` of
        ``memory_limit`` (none without one): the fastest step the memory holds;
        ``checkpointed`` says how many layers it recomputes.  ``method``: a row
        of ``train.methods``; a preference method's step takes ``batch_size`` pairs
        (``2 * batch_size`` sequences) a micro-batch and records
        ``train.preference.record_preference`` instead of the next-token loss; ``options``
        its numbers.  With ``memory_limit`` set, a step that would not fit even checkpointed is refused
        here, before anything is allocated (``GradtapeError`` naming what it needs, then
        ``memory_hint``).  ``fine_tune_type``: "lora" or "dora" trains ``adapter`` (its
        magnitudes say which); "full" trains every weight (``train.full``; ``adapter`` is
        None)."""
        if fine_tune_type not in full.FINE_TUNE_TYPES:
            raise ValueError(f"TrainStep: fine_tune_type must be one of "
                             f"{full.FINE_TUNE_TYPES}, got {fine_tune_type!r}")
        self.full = fine_tune_type == "full"
        if grad_checkpoint not in GRAD_CHECKPOINT:
            raise ValueError(f"TrainStep: grad_checkpoint must be one of {GRAD_CHECKPOINT}, "
                             f"got {grad_checkpoint!r}")
        self.grad_checkpoint, self.memory_limit = grad_checkpoint, memory_limit
        self.memory_hint = memory_hint
        self.backend = backend
        self.model, self.adapter = model, adapter
        self.method, self.options = method_row(method), options
        self.preference = self.method.data == "preference"
        self.metrics = {}  # the last step's metrics (TRL's names); none for sft
        # every choice of the run, decided once (``gradtape.plan``): the frozen-weight
        # GEMMs' precision, the attention's route, ...; the programs carry it out
        cfg = model.config
        n_seq = 2 * batch_size if self.preference else batch_size  # sequences a micro-batch
        self.plan = for_training(cfg, n_seq, seq_len, backend, dtype, compute,
                                 attention=attention_from)
        if self.full and self.plan.compute.value != "float32":
            self.plan = self.plan.replace(trained_bf16=Decision(True, full.BF16_WHY))
        elif not self.full:  # a full step reads no block weight
            self.plan = resident_weights(
                self.plan, resident_copy_bytes(model.weights),
                memory_limit if memory_limit is not None else mem_available())
        self.world = world if world is not None and world.size > 1 else None
        self.stop_agreed = False  # distributed: did any rank ask to stop at the last step
        self.batch_size, self.seq_len, self.grad_accum = batch_size, seq_len, grad_accum
        tp = Tape(dtype, eager=False)
        self.tape = tp
        # the step's programs (step, eval; MPI: gradients, update) never run at the same
        # time: their intermediates share one arena, sized for the largest
        self.arena = SharedArena()
        W = full.weight_params(tp, model) if self.full else weight_consts(tp, model)
        if self.preference:
            self._record_preference(W, batch_size, seq_len, backend)
        else:
            self._record_sft(W, batch_size, seq_len, backend)
        # the weights a full step trains (every one the loss reads), else the adapter's
        self.trained = {k: w for k, w in W.items() if w in self.grads} if self.full else {}
        params = list(self.trained.values()) if self.full else leaf_params(self.lora)
        g = [self.grads[p] for p in params]
        # what runs, recorded in the plan: a model with no weight big enough for a bf16
        # GEMM stays float32; int8 is for the weights kept in their ggml blocks
        ran = getattr(self.eval_program.executable, "compute", "float32")
        if ran != self.compute:
            self.plan = self.plan.replace(compute=Decision(ran, (
                "no weight is kept in ggml blocks for an int8 GEMM" if ran == "bf16"
                else "no weight is big enough for a bf16 GEMM")))
        if ran == "float32":
            self.plan = self.plan.replace(trained_bf16=Decision(False, ""))
        if self.world is not None:
            self._compile_split(params, g, opt, clip, backend)
            return

        updates = {}
        self.apply = None
        if grad_accum > 1:
            # g_total = acc + g; the accumulator keeps it until the step's last micro-batch
            self.apply = tp.const(np.ones((), dtype))
            keep = ops.addc(ops.neg(self.apply), 1.0)
            self.accumulators = [tp.const(np.zeros(p.shape, dtype)) for p in params]
            g = [ops.add(acc, gi) for acc, gi in zip(self.accumulators, g)]
            updates.update({acc: ops.mul(gi, keep) for acc, gi in zip(self.accumulators, g)})
        else:
            self.accumulators = []
        if clip and clip > 0:
            g, self.grad_norm = clip_by_global_norm(g, clip)
        else:
            self.grad_norm = global_norm(g)
        new, self.scalars, moments = adamw(tp, params, g, opt)
        if self.apply is not None:  # state changes only when the step applies
            new = {leaf: ops.select(self.apply, v, leaf) for leaf, v in new.items()}
        updates.update(new)
        self.state_leaves = {"param": params, "m": [m for m, _ in moments],
                             "v": [v for _, v in moments], "acc": self.accumulators}
        outputs = [self.loss, self.grad_norm, *self.metric_vars.values()]
        self.checkpointed = self._decide_checkpoint(outputs, updates)
        self._record_checkpoint()
        # the state lives in the tape's own arrays (``Tape.param`` copies): no second copy
        self.program = tp.compile(outputs, backend=backend, updates=updates,
                                  plan=self.plan, checkpoint=self.checkpointed,
                                  donate=list(updates), arena=self.arena)
        self.plan = self.program.execution
        # a full step's eval program reads the params where the step keeps them: a copy
        # of every weight less (an adapter is small: it is fed, as it always was)
        self._eval_shares = self.full and self.eval_program.share_state(self.program, params)
        self._set_no_target([self.program, self.eval_program])

    def _set_no_target(self, programs):
        """``no_target``: the target id the feeds give a row without one."""
        targets = self.graph.leaves["targets"] if self.preference else self.targets
        self.no_target = no_target_id(targets, programs)

    def _record_sft(self, W, batch_size, seq_len, backend):
        """The next-token loss of ``batch_size`` rows, its gradients, the eval program."""
        tp, model, dtype = self.tape, self.model, self.tape.dtype
        rows = batch_size * seq_len
        self.ids = tp.const(np.zeros(rows, np.int64))
        self.targets = tp.const(np.zeros(rows, np.int64))
        self.weights = tp.const(np.zeros((rows, 1), dtype))
        # each token's position and example within its row: rows may pack several examples
        self.positions = tp.const(np.zeros(rows, np.int64))
        self.segments = tp.const(np.zeros(rows, np.int64))
        self.lora = self._adapter_params()
        hidden = record_forward(tp, model.config, W, self.ids, batch_size, self.lora,
                                self._scale, positions=self.positions,
                                segments=self.segments, head=False,
                                fused_from=self.plan.attention_from.value)  # [B*T, D]
        # the LM head and the loss (fused for long rows: no [B*T, V] logits)
        fuse_from, budget = (full.HEAD_FUSE_FROM, full.HEAD_BUDGET) if self.full else (None,
                                                                                    None)
        self.loss = head_loss(tp, model.config, W, hidden, self.targets, self.weights,
                              fuse_from=fuse_from, budget=budget)
        self.grads = tp.backward(self.loss)
        self.metric_vars = {}
        eval_loss = head_loss(tp, model.config, W, hidden, self.targets, self.weights,
                              training=False, fuse_from=fuse_from, budget=budget)
        self.eval_program = tp.compile([eval_loss], backend=backend, plan=self.plan,
                                       arena=self.arena)

    def _record_preference(self, W, batch_size, seq_len, backend):
        """The method's loss over ``batch_size`` pairs (``train.preference``): one forward
        over the ``2 * batch_size`` sequences; the eval program outputs the loss, the
        policy's log-probabilities (what the reference pass keeps) and the metrics."""
        tp = self.tape
        self.lora = self._adapter_params()
        self._base = {}  # pairs -> the base model's forward, on demand (reference_logps)
        self._weights, self._backend = W, backend
        # a placeholder batch gives the leaves their shapes; every step feeds its own
        dummy = [([0, 0], [0, 1], [0, 0], [0, 1])] * batch_size
        ref = np.zeros(2 * batch_size) if self.method.reference else None
        self.graph = record_preference(tp, self.model.config, W, self.lora, self._scale,
                                       self.method, pair_batch(dummy, seq_len, False),
                                       self.options, ref,
                                       fused_from=self.plan.attention_from.value)
        self.metric_vars = self.graph.metrics
        # each micro-batch's loss weighted by its share of the step's pairs (1 / grad_accum,
        # as TRL averages its micro-batches' losses); 1 without accumulation
        self.share = tp.const(np.ones(self.graph.loss.shape, tp.dtype))
        self.loss = ops.mul(self.graph.loss, self.share)
        self.grads = tp.backward(self.loss)
        # the held-out evaluation weighs each pair (``PairData.batches``: padding by 0)
        self.eval_program = tp.compile([self.graph.eval_loss, self.graph.eval_logps,
                                        *self.graph.eval_metrics.values()],
                                       backend=backend, plan=self.plan, arena=self.arena)

    def _adapter_params(self):
        """The adapter's leaves (``models.dora.adapter_leaves``; none when full)."""
        if self.full:
            return {}
        return adapter_leaves(self.tape, self.adapter, self.model.weights)  # DoRA: 4 leaves

    @property
    def _scale(self):
        return 1.0 if self.full else self.adapter.scale

    @property
    def n_param(self) -> int:
        """Values trained: the adapter's, or every weight's (full)."""
        if self.full:
            return sum(p.size for p in self.trained.values())
        return sum(p.size for p in leaf_params(self.lora))

    @property
    def state_copies(self) -> int:
        """Copies of each trained value the step holds (params, moments, accumulator,
        the eval program's), for the memory estimate."""
        if self.full:  # MPI: the gradients program's params, the eval program's own
            return (full.STEP_COPIES + (1 if self.grad_accum > 1 else 0)
                    + (2 if self.world is not None else 0))
        return 4  # the params (the tape's arrays, the step's state), 2 moments, the eval's

    @property
    def compute(self) -> str:
        """The frozen-weight GEMMs' precision that runs ("float32", "bf16", "int8")."""
        return self.plan.compute.value

    @property
    def compute_why(self) -> str:
        return self.plan.compute.why

    @property
    def attention_from(self) -> int:
        """The rows per sequence from which the attention is the fused primitive."""
        return self.plan.attention_from.value

    @property
    def attention_why(self) -> str:
        return self.plan.attention_from.why

    def planned_memory(self, checkpoint):
        """The ``memory.Estimate`` of the run with the step's program compiled with
        activation checkpointing (True: every layer recomputed; a number n: the first
        n), or without it (False or 0), from the passes' memory plan (nothing allocated),
        and the eval program built before it."""
        outputs, updates = self._step_graph
        return planned(self.model, self.tape, outputs, updates, self.n_param, checkpoint,
                       self.backend, built=[self.eval_program], copies=self.state_copies,
                       full=self.full, shared=True)

    def _record_checkpoint(self):
        self.plan = self.plan.replace(checkpoint=Decision(
            self.checkpointed, f"{self.checkpointed} of {self.model.config.n_layers} layers "
                               f"recomputed (--grad-checkpoint {self.grad_checkpoint}"
                               f"{self._checkpoint_why})"))

    def _decide_checkpoint(self, outputs, updates):
        """How many layers to recompute in backward (0: none; every layer with "on"; with
        "auto", every layer where that frees enough memory for its work
        (``recompute_pays``), else the fewest for a run within ``AUTO_SHARE`` of the
        limit with activations at most ``AUTO_ACTIVATIONS`` of it; with "fit", the
        fewest for a run within ``AUTO_SHARE`` of the limit), from the memory plans (no
        allocation); refuses a step that fits no way."""
        mode, limit = self.grad_checkpoint, self.memory_limit
        self._step_graph = (outputs, updates)
        self._checkpoint_why = ""
        layers = self.model.config.n_layers
        if mode in ("off", "fit") and limit is None:
            return 0
        est = None
        if mode in ("auto", "fit"):
            off, est = self.planned_memory(0), self.planned_memory(layers)
            need_off, pays = off.total, mode == "auto" and recompute_pays(off, est)
            # the run whose activations are AUTO_ACTIVATIONS of it (the rest stays)
            budget = ((need_off - off.activations) / (1 - AUTO_ACTIVATIONS)
                      if mode == "auto" else math.inf)
            if limit is not None:
                budget = min(budget, AUTO_SHARE * limit)
            if not pays and need_off <= budget:
                return 0
            freed = (need_off - est.total) / need_off
            of_run = (f"{freed:.0%} of the run" if freed >= AUTO_FREES else
                      f"{(need_off - est.total) / 2**20:.0f} MB beside "
                      f"{off.state / 2**30:.1f} GiB of trained state")
            self._checkpoint_why = (
                f": frees {of_run} at "
                f"{(need_off - est.total) / 2**20 / max(est.flops - off.flops, 1) * 1e9:.1f}"
                " MB per GFLOP recomputed" if pays else
                ": activations within a third of the run" if budget < need_off and (
                    limit is None or budget < AUTO_SHARE * limit) else
                ": the run within 3/4 of the memory available")
        n = layers if mode != "off" else 0
        est = est or self.planned_memory(n)
        if limit is not None and est.total > limit:
            how = "with" if n else "without"
            raise GradtapeError(
                f"not enough memory: this run needs {est.describe()} {how} activation "
                f"checkpointing, but only {limit / GiB:.1f} GiB is available"
                + ("" if n else " (--grad-checkpoint on would need less)")
                + self.memory_hint)
        if mode in ("auto", "fit") and not pays and est.total < budget:
            n = self._fewest_recomputed(need_off, est.total, budget)
        elif mode == "auto" and pays and freed < AUTO_FREES and need_off > est.total + 2**20:
            # beside a large state: as few layers as reach all layers' plan (its peak may
            # be set by what no recompute frees, such as the embedding's gradient)
            n = self._fewest_recomputed(need_off, est.total, est.total + 2**20)
            self._checkpoint_why += "; the fewest layers that free as much"
        if mode == "auto" and n and limit is not None and need_off <= AUTO_SHARE * limit:
            self._checkpoint_why += (f"; --grad-checkpoint fit would recompute none, in about "
                                     f"{need_off / GiB:.1f} GiB, for faster steps")
        return n

    def _fewest_recomputed(self, need_none, need_all, budget):
        """The fewest layers to recompute for a plan within ``budget`` bytes, given the
        plans recomputing none (over it) and all (within it): each layer recomputed
        saves about the same, so each guess interpolates between the closest plans on
        either side (two or three plans for an 8B model)."""
        lo, hi = (0, need_none), (self.model.config.n_layers, need_all)
        while hi[0] - lo[0] > 1:
            guess = lo[0] + math.ceil((hi[0] - lo[0]) * (lo[1] - budget) / (lo[1] - hi[1]))
            n = min(max(guess, lo[0] + 1), hi[0] - 1)
            need = self.planned_memory(n).total
            if need <= budget:
                hi = (n, need)
            else:
                lo = (n, need)
        return hi[0]

    def _compile_split(self, params, g, opt, clip, backend):
        """The distributed step: ``grads_program`` -> Allreduce -> ``update_program``."""
        tp, dtype = self.tape, self.tape.dtype
        self.stop = tp.const(np.zeros(1, dtype))
        # a preference method's metrics ride along, weighted as its loss
        metrics = [ops.reshape(ops.mul(v, self.share), (1,)) for v in self.metric_vars.values()]
        flat = ops.concat([ops.reshape(gi, (gi.size,)) for gi in g]
                          + [ops.reshape(self.loss, (1,)), *metrics, self.stop], 0)  # [P+2+M]
        updates = {}
        self.apply = None
        self.accumulators = []
        if self.grad_accum > 1:
            self.apply = tp.const(np.ones((), dtype))
            keep = ops.addc(ops.neg(self.apply), 1.0)
            acc = tp.const(np.zeros(flat.shape, dtype))
            flat = ops.add(acc, flat)
            updates[acc] = ops.mul(flat, keep)
        self.checkpointed = self._decide_checkpoint([flat], updates)
        self._record_checkpoint()
        self.grads_program = tp.compile([flat], backend=backend, updates=updates,
                                        plan=self.plan, checkpoint=self.checkpointed,
                                        arena=self.arena)
        self.plan = self.grads_program.execution
        self._set_no_target([self.grads_program, self.eval_program])
        # the summed vector, sliced back into per-param gradients
        self.reduced = tp.const(np.zeros(flat.shape, dtype))
        gs, off = [], 0
        for p in params:
            gs.append(ops.reshape(ops.slice_(self.reduced, 0, off, off + p.size), p.shape))
            off += p.size
        if clip and clip > 0:
            gs, self.grad_norm = clip_by_global_norm(gs, clip)
        else:
            self.grad_norm = global_norm(gs)
        new, self.scalars, moments = adamw(tp, params, gs, opt)
        # checkpoints keep the single-process layout ("acc" is all zeros between steps), so
        # a run can resume with another number of ranks
        self.state_leaves = {"param": params, "m": [m for m, _ in moments],
                             "v": [v for _, v in moments], "acc": []}
        self.program = tp.compile([self.grad_norm], backend=backend, updates=new,
                                  donate=list(new), arena=self.arena)

    def _step_split(self, micro_feeds, scalars, stop):
        """One distributed step over this rank's micro-batches' leaves ``micro_feeds``."""
        for i, feeds in enumerate(micro_feeds):
            last = i == len(micro_feeds) - 1
            feeds = {**feeds, self.stop: np.asarray([float(stop and last)])}
            if self.apply is not None:
                feeds[self.apply] = np.asarray(float(last))
            (flat,) = self.grads_program.run(feeds)
        self.world.allreduce_sum(flat)  # the one collective of the step
        (norm,) = self.program.run({self.reduced: flat, **scalars})
        self.grads_program.set_state(self.current_params())
        self.stop_agreed = bool(flat[-1] > 0)
        k = len(self.metric_vars)  # [..., loss, metrics, stop]
        self.metrics = {name: float(v) for name, v in zip(self.metric_vars, flat[-1 - k:-1])}
        return float(flat[-2 - k]), float(norm)

    def _feeds(self, batch, denominator):
        """A micro-batch's leaves: ``batch`` is ``(ids, targets)`` (one example a row, at
        positions 0..T-1) or ``(ids, targets, positions, segments)``, each ``[B, T]``."""
        ids, targets, *layout = batch
        if not layout:
            layout = (np.broadcast_to(np.arange(self.seq_len), ids.shape), np.zeros_like(ids))
        positions, segments = layout
        tid, w = nn.ce_targets_fill(targets.reshape(-1), denominator=denominator,
                                    no_target=self.no_target)
        return {self.ids: ids.reshape(-1), self.targets: tid, self.weights: w,
                self.positions: np.ascontiguousarray(positions).reshape(-1),
                self.segments: np.ascontiguousarray(segments).reshape(-1)}

    def step(self, micro_batches, opt_step, lr, n_tokens=None, stop=False):
        """Run one optimizer step over ``micro_batches`` (a list of (ids [B, T], targets
        [B, T]), or of (ids, targets, positions, segments) for packed rows: see
        ``_feeds``).  ``opt_step`` is 1-based.  Returns (mean loss, grad norm).

        Distributed: ``micro_batches`` is this rank's shard, ``n_tokens`` the target-token
        count of the whole global step, ``stop`` this rank's wish to stop after the step;
        afterwards ``stop_agreed`` tells whether any rank wished it."""
        if self.preference:
            return self._step_preference(micro_batches, opt_step, lr, stop)
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"step: expected {self.grad_accum} micro-batches, got "
                             f"{len(micro_batches)}")
        if n_tokens is None:
            n_tokens = sum(int((b[1] != IGNORE).sum()) for b in micro_batches)
        scalars = self.scalars.values(opt_step, lr)
        if self.world is not None:
            return self._step_split([self._feeds(b, max(n_tokens, 1)) for b in micro_batches],
                                    scalars, stop)
        self.stop_agreed = stop
        total, norm = 0.0, float("nan")
        for i, batch in enumerate(micro_batches):
            feeds = {**self._feeds(batch, max(n_tokens, 1)), **scalars}
            if self.apply is not None:
                feeds[self.apply] = np.asarray(float(i == len(micro_batches) - 1))
            loss, norm = self.program.run(feeds)
            total += float(loss)
        return total, float(norm)

    def _step_preference(self, micro_batches, opt_step, lr, stop=False):
        """One step over ``[(PairBatch, ref)]`` (``grad_accum`` micro-batches, each
        ``train.preference``'s batch of ``batch_size`` pairs and the reference's ``[2N]``
        log-probabilities of those pairs, ``None`` for a method without one): the loss is
        the mean of the micro-batches' losses, and so is each metric (``metrics``).
        Distributed: this rank's pairs of each global micro-batch (``PairData.micro``)."""
        n = len(micro_batches)
        if n != self.grad_accum:
            raise ValueError(f"step: expected {self.grad_accum} micro-batches, got {n}")
        scalars = self.scalars.values(opt_step, lr)
        ranks = 1 if self.world is None else self.world.size
        share = np.full(self.share.shape, 1.0 / (n * ranks), self.tape.dtype)
        if self.world is not None:
            return self._step_split([{**self.graph.feeds(batch, ref, self.no_target),
                                      self.share: share}
                                     for batch, ref in micro_batches], scalars, stop)
        total, norm, metrics = 0.0, float("nan"), dict.fromkeys(self.metric_vars, 0.0)
        for i, (batch, ref) in enumerate(micro_batches):
            feeds = {**self.graph.feeds(batch, ref, self.no_target), **scalars,
                     self.share: share}
            if self.apply is not None:
                feeds[self.apply] = np.asarray(float(i == n - 1))
            loss, norm, *values = self.program.run(feeds)
            total += float(loss)
            for k, v in zip(self.metric_vars, values):
                metrics[k] += float(v) / n
        self.metrics = metrics
        self.stop_agreed = stop
        return total, float(norm)

    def eval_preference(self, batches):
        """``(loss, metrics, logps)`` over ``batches`` (``[(PairBatch, ref, weight)]``)
        with the current adapter: the loss and each metric averaged over the batches with
        their weights (each batch's share of the pairs), ``logps`` each batch's policy
        log-probabilities ``[2N]`` (the reference pass keeps them)."""
        params = self._eval_params()
        loss, metrics, logps = 0.0, dict.fromkeys(self.metric_vars, 0.0), []
        for batch, ref, weight in batches:
            ref = np.zeros(2 * batch.n_pairs) if ref is None and self.method.reference else ref
            feeds = self.graph.feeds(batch, ref, self.no_target)
            out, lp, *values = self.eval_program.run({**params, **feeds})
            loss += weight * float(out)
            for k, v in zip(self.metric_vars, values):
                metrics[k] += weight * float(v)
            logps.append(np.asarray(lp, np.float64).reshape(-1))
        return loss, metrics, logps

    def reference_pairs(self, n) -> int:
        """Pairs a batch of ``reference_logps`` over ``n`` pairs: the step's micro-batch,
        or where the base model's forward runs, as many as ``plan.reference_pairs``."""
        return reference_pairs(n, self.seq_len) if self._base_is_policy() else self.batch_size

    def reference_logps(self, batches):
        """Each of ``batches``' (``[(PairBatch, ref, weight)]``) log-probabilities ``[2N]``
        under the model as it is now, the reference a DPO run keeps.  Where the policy is
        the model's forward alone (``_base_is_policy``), that forward runs
        (``record_base_logps``, one program per batch size, compiled on first use): the
        eval program's values to rounding, without the adapter's products or the loss;
        else the eval program's (``eval_preference``, batches of ``batch_size`` pairs)."""
        if not self._base_is_policy():
            return self.eval_preference(batches)[2]
        out = []
        for batch, _, _ in batches:
            n = batch.n_pairs
            if n not in self._base:
                base = record_base_logps(self.tape, self.model.config, self._weights, n,
                                         self.seq_len, self.plan.attention_from.value)
                program = self.tape.compile([base.logps], backend=self._backend,
                                            plan=self.plan, arena=self.arena)
                # full fine-tuning's weights are the step's params: read where it keeps
                # them, or fed (copied) where the backend cannot share them
                trained = list(self.trained.values())
                fed = bool(trained) and not program.share_state(self.program, trained)
                no_target = no_target_id(base.leaves["targets"], [program])
                self._base[n] = base, program, fed, no_target
            base, program, fed, no_target = self._base[n]
            feeds = {**(self.current_params() if fed else {}), **base.feeds(batch, no_target)}
            out.append(np.asarray(program.run(feeds)[0], np.float64).reshape(-1))
        return out

    def release_reference(self):
        """Drop the base model's programs (``reference_logps``) once the pass is done."""
        self._base = {}

    def _base_is_policy(self) -> bool:
        """Whether the policy is the model's forward alone: full fine-tuning (its params
        are the weights), or LoRA (not DoRA, whose magnitude rescales) with every B zero,
        whose products add exactly zero."""
        if self.full:
            return True
        if any(len(leaves) != 2 for leaves in self.lora.values()):
            return False
        params = self.current_params()
        return not any(params[b].any() for _, b in self.lora.values())

    def eval_loss(self, seqs):
        """Mean next-token loss over ``seqs`` (a data.Sequences) with the current adapter."""
        feeds = self._eval_params()
        total, count = 0.0, 0
        b = self.batch_size
        for s in range(0, len(seqs), b):
            batch = seqs.batch(slice(s, s + b))
            n = len(batch[0])
            if n < b:  # pad the last batch with rows that count for nothing
                filler = empty_rows(b - n, self.seq_len).batch(slice(None))
                batch = [np.concatenate([x, f]) for x, f in zip(batch, filler)]
            k = int((batch[1] != IGNORE).sum())
            (loss,) = self.eval_program.run({**feeds, **self._feeds(batch, 1)})
            total, count = total + float(loss), count + k
        return total / max(count, 1)

    def _eval_params(self):
        """The eval program's param feeds: none where it reads the step's own."""
        return {} if getattr(self, "_eval_shares", False) else self.current_params()

    def current_params(self):
        return {p: self.program.state(p) for p in self.state_leaves["param"]}

    def adapter_weights(self):
        """The trained adapter weights {(layer, target): (A, B)} as float32 arrays."""
        out = {}
        for key, (a, b, *_) in self.lora.items():
            out[key] = (self.program.state(a).astype(np.float32),
                        self.program.state(b).astype(np.float32))
        return out

    def adapter_magnitudes(self):
        """A DoRA adapter's trained magnitudes {(layer, target): m} as float32 arrays
        (empty for LoRA)."""
        return {key: self.program.state(leaves[2]).astype(np.float32)
                for key, leaves in self.lora.items() if len(leaves) == 4}

    def model_weights(self, live=False):
        """The trained weights of a full step ``{name: float32 array}`` (our names and
        orientation), with any weight the loss does not read as the model has it; each
        read from the program when asked (``StateArrays``: a writer holds one at a time).
        ``live``: the arrays the program keeps them in, in the step's dtype, no copy (a
        reader done before the next step, such as the samples' generation)."""
        if live:
            arrays = {k: self.program.executable.leaf_array(leaf)
                      for k, leaf in self.trained.items()}
            if all(a is not None for a in arrays.values()):
                return {**self.model.weights, **arrays}
        return StateArrays({
            k: (functools.partial(_float32_state, self.program, self.trained[k])
                if k in self.trained else functools.partial(operator.getitem,
                                                            self.model.weights, k))
            for k in self.model.weights})

    def state_arrays(self):
        """Everything a checkpoint needs, as named arrays, each read from the program
        when asked (``StateArrays``: a full step's state is several GB)."""
        read = {f"{kind}.{i}": functools.partial(self.program.state, leaf)
                for kind, leaves in self.state_leaves.items() for i, leaf in enumerate(leaves)}
        if self.world is not None and self.grad_accum > 1:  # the single-process layout
            read.update({f"acc.{i}": functools.partial(np.zeros, p.shape, self.tape.dtype)
                         for i, p in enumerate(self.state_leaves["param"])})
        return StateArrays(read)

    def load_state_arrays(self, arrays):
        values = {}
        for kind, leaves in self.state_leaves.items():
            for i, leaf in enumerate(leaves):
                arr = arrays.get(f"{kind}.{i}")
                if arr is None or arr.shape != leaf.shape:
                    raise ValueError(f"checkpoint: {kind}.{i} is missing or has the wrong shape")
                values[leaf] = arr
        self.program.set_state(values)
        if self.world is not None:
            self.grads_program.set_state(self.current_params())
