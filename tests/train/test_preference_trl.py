"""The preference methods against TRL's own trainer code, on small random models.

For llama3, qwen2 and gemma3 (``families.py``'s random Hugging Face folders) with a
PEFT LoRA whose B is random and non-zero, and one batch of 2 pairs (completions of
different lengths, the prompt tokens masked), our loss, TRL's metrics and every adapter
gradient equal TRL 1.16's: ``DPOTrainer._compute_loss`` (``sigmoid``, ``robust``,
``ipo``; its reference is the base model, the adapter disabled), ``ORPOTrainer.
get_batch_loss_metrics`` and ``CPOTrainer.get_batch_loss_metrics`` (``simpo``,
``cpo_alpha=0``).  The trainers' methods run on a stand-in ``self`` holding only the
attributes they read, so no dataset pipeline is built.

Float64: TRL computes some steps in float32 whatever the model's dtype (its fused LM
head kernel; ORPO's ``.float()`` casts); the reference replaces those with the same math
in the input dtype, as ``test_families`` removes transformers' float32 casts.  The model
is ``test_families``' float64 reference.  Float32 runs TRL unchanged.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict

import numpy as np
import pytest

from support.adapters import random_adapter
from support.compare import rel_err

import gradtape as gt
from gradtape.models.graph import logps_fused, weight_consts
from gradtape.train import methods as M
from gradtape.train import preference as P
from gradtape.train.step import no_target_id

import torch  # test-only references, installed by make test
import trl  # noqa: F401  (imported: a broken install fails here)

pytestmark = pytest.mark.slow  # transformers, PEFT and TRL per family and method

FAMILIES = ["llama3", "qwen2", "gemma3"]
# case -> (our method, options, TRL's trainer and loss type)
CASES = {"dpo": ("dpo", M.Options(), "sigmoid"),
         "robust": ("dpo", M.Options(beta=0.2, label_smoothing=0.1), "robust"),
         "ipo": ("ipo", M.Options(beta=0.3), "ipo"),
         "orpo": ("orpo", M.Options(beta=0.25), "orpo"),
         "simpo": ("simpo", M.Options(beta=2.0, simpo_gamma=0.7), "simpo")}
TOL = {np.float64: 1e-10, np.float32: 1e-5}
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected"]


def _pairs(vocab, seed=0):
    """2 pairs: prompts of 3 and 4 tokens, completions of 4/3 and 2/5 tokens."""
    rng = np.random.default_rng(seed)
    tok = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    out = []
    for plen, (nc, nr) in ((3, (4, 3)), (4, (2, 5))):
        p, c, r = tok(plen), tok(nc), tok(nr)
        out.append((p + c, [0] * plen + [1] * nc, p + r, [0] * plen + [1] * nr))
    return out


# --- TRL's side ----------------------------------------------------------------------------

class _Acc:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics

    @staticmethod
    def unwrap_model(m):
        return m


class _LogProbs64:
    """TRL's chunked LM-head log-probabilities (``kernels.ChunkedLogProbFunction``) in the
    input dtype: the same transform (scale, soft-cap, temperature) and outputs."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk, softcap, logit_scale, outputs):
        z = hidden @ weight.T
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, labels[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        return lp, ent, None, z.mean(-1), z.argmax(-1) == labels


@contextlib.contextmanager
def _keep_float64():
    """``Tensor.float()`` leaves a float64 tensor as it is (ORPO's casts)."""
    orig = torch.Tensor.float
    torch.Tensor.float = (lambda self, *a, **k:
                          self if self.dtype == torch.float64 else orig(self, *a, **k))
    try:
        yield
    finally:
        torch.Tensor.float = orig


def _peft(folder, model, ad, dtype):
    from peft import LoraConfig, get_peft_model
    from test_families import _hf, _hf64, _peft_targets

    from gradtape.models.lora import PEFT_MODULES
    hf = _hf64(folder, model.config) if dtype == np.float64 else _hf(folder)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    pm = get_peft_model(hf, LoraConfig(r=ad.rank, lora_alpha=ad.alpha, lora_dropout=0.0,
                                       target_modules=_peft_targets(model.config),
                                       task_type="CAUSAL_LM")).to(tdt)
    mods = dict(pm.named_modules())
    keys = list(ad.weights)

    def mod(layer, target):
        return mods[f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"]
    with torch.no_grad():
        for (layer, target), (a, b) in ad.weights.items():
            m = mod(layer, target)
            m.lora_A["default"].weight.copy_(torch.tensor(a.T, dtype=tdt))
            m.lora_B["default"].weight.copy_(torch.tensor(b.T, dtype=tdt))
    grads = lambda: [g for k in keys for g in (  # noqa: E731
        mod(*k).lora_A["default"].weight.grad.double().numpy().T,
        mod(*k).lora_B["default"].weight.grad.double().numpy().T)]
    return pm, keys, grads


def _trl_dpo(pm, pairs, t, loss_type, opt, beta, dtype, monkeypatch):
    import trl.trainer.utils as tu
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    if dtype == np.float64:
        monkeypatch.setattr(tu, "_ChunkedLogProbFunction", _LogProbs64)
    add_fused_lm_head(pm.get_base_model(), outputs=("log_probs", "entropy", "mean_logits",
                                                    "is_top1"))
    seqs = [(p[0], p[1]) for p in pairs] + [(p[2], p[3]) for p in pairs]
    ids = torch.zeros((len(seqs), t), dtype=torch.long)
    att, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for s, (tok, mask) in enumerate(seqs):
        ids[s, :len(tok)] = torch.tensor(tok)
        att[s, :len(tok)] = 1
        comp[s, :len(tok)] = torch.tensor(mask)
    me = types.SimpleNamespace(
        model=pm, ref_model=None, accelerator=_Acc(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=opt.label_smoothing, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    loss = DPOTrainer._compute_loss(me, pm, {"input_ids": ids, "attention_mask": att,
                                             "completion_mask": comp}, False)
    loss.backward()
    mode = "train" if pm.training else "eval"
    return loss.item(), {k: v[-1] for k, v in me._metrics[mode].items()}


def _trl_pairs(pm, pairs, t, loss_type, opt, beta, dtype):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    batch = {}
    for side, (ti, mi) in (("chosen", (0, 1)), ("rejected", (2, 3))):
        ids = torch.zeros((len(pairs), t), dtype=torch.long)
        att, lab = torch.zeros_like(ids), torch.full_like(ids, -100)
        for s, p in enumerate(pairs):
            tok, mask = torch.tensor(p[ti]), torch.tensor(p[mi])
            ids[s, :len(tok)] = tok
            att[s, :len(tok)] = 1
            lab[s, :len(tok)] = torch.where(mask == 1, tok, -100)
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": att,
                      f"{side}_labels": lab})
    cls = ORPOTrainer if loss_type == "orpo" else CPOTrainer
    me = types.SimpleNamespace(
        accelerator=_Acc(), is_encoder_decoder=False, padding_value=0, pad_token_id=0,
        aux_loss_enabled=False, beta=beta, label_smoothing=opt.label_smoothing,
        loss_type=loss_type, simpo_gamma=opt.simpo_gamma, cpo_alpha=0.0, alpha=0.0)
    for name in ("concatenated_inputs", "concatenated_forward", "get_batch_logps",
                 "odds_ratio_loss", "cpo_loss"):
        if hasattr(cls, name):
            setattr(me, name, types.MethodType(getattr(cls, name), me)
                    if name not in ("concatenated_inputs", "get_batch_logps")
                    else getattr(cls, name))
    with _keep_float64() if dtype == np.float64 else contextlib.nullcontext():
        loss, metrics = cls.get_batch_loss_metrics(me, pm, batch)
    loss.backward()
    return loss.item(), metrics


# --- ours ---------------------------------------------------------------------------------

def _ours(model, ad, pairs, t, name, opt, dtype):
    m = M.method(name)
    batch = P.pair_batch(pairs, t, m.average)
    ref = P.reference_logps(model, None, m, batch, dtype) if m.reference else None
    tp = gt.Tape(dtype, eager=False)
    W = weight_consts(tp, {k: np.asarray(w).astype(dtype) for k, w in model.weights.items()})
    lora = {k: (tp.param(a.astype(dtype)), tp.param(b.astype(dtype)))
            for k, (a, b) in ad.weights.items()}
    g = P.record_preference(tp, model.config, W, lora, ad.scale, m, batch, opt, ref)
    grads = tp.backward(g.loss)
    names = list(g.metrics)
    prog = tp.compile([g.loss, *g.metrics.values(), *(grads[p] for k in lora for p in lora[k])])
    # the fused head skips the rows no sum counts (fed -1): TrainStep's feeds
    no_target = no_target_id(g.leaves["targets"], [prog])
    assert no_target == (-1 if logps_fused(model.config, len(batch.ids)) else 0)
    outs = prog.run(g.feeds(batch, ref, no_target))
    return float(outs[0]), dict(zip(names, (float(o) for o in outs[1:1 + len(names)]))), \
        outs[1 + len(names):]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_preference_loss_and_gradients_equal_trl(family, case, dtype, folders, monkeypatch):
    _check(family, case, dtype, folders, monkeypatch)


@pytest.mark.parametrize("case", ["dpo", "orpo"])
def test_fused_head_logps_equal_trl(case, folders, monkeypatch):
    """The same through the fused LM head (``graph.LOGPS_FUSE_MIN``: a preference batch
    of real size takes it; these tiny ones would not)."""
    from gradtape.models import graph
    monkeypatch.setattr(graph, "LOGPS_FUSE_MIN", 0)
    _check("llama3", case, np.float64, folders, monkeypatch)


def _check(family, case, dtype, folders, monkeypatch):
    from gradtape import llama
    name, opt, loss_type = CASES[case]
    folder = folders(family)
    model = llama.load(folder)
    ad = random_adapter(model.config, rank=2, alpha=4.0, base_model=model.name)
    pairs = _pairs(model.config.vocab_size)
    t = max(len(p[k]) for p in pairs for k in (0, 2))
    beta = M.check_options(M.method(name), opt)

    pm, keys, ref_grads = _peft(folder, model, ad, dtype)
    if name in ("dpo", "ipo"):
        ref_loss, ref_m = _trl_dpo(pm, pairs, t, loss_type, opt, beta, dtype, monkeypatch)
    else:
        ref_loss, ref_m = _trl_pairs(pm, pairs, t, loss_type, opt, beta, dtype)
    loss, metrics, grads = _ours(model, ad, pairs, t, name, opt, dtype)

    tol = TOL[dtype]
    errs = {"loss": rel_err(loss, ref_loss)}
    # a reward is beta times a difference of log-probabilities: measured against the
    # size of what it cancels (float32 logps carry ~1e-7 of their own size)
    size = beta * max(abs(ref_m["logps/chosen"]), abs(ref_m["logps/rejected"]))
    errs.update({k: abs(metrics[k] - ref_m[k]) / max(abs(ref_m[k]), size if "rewards" in k
                                                    else 0.0, 1e-300) for k in METRICS})
    errs["grads"] = max(rel_err(a, b) for a, b in zip(grads, ref_grads()))
    print(f"PREF {family} {case} {np.dtype(dtype).name} "
          + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    assert all(e <= tol for e in errs.values()), errs
