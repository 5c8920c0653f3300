"""Full fine-tuning against transformers: on two-layer random models of three families
(``families.py``), one sequence, the gradient of every weight (norms and embeddings too;
a tied head's table once) equals what ``loss.backward()`` gives on the transformers model,
through the parameters a full ``TrainStep`` makes (``train.full.weight_params``) and the
training's own head and loss.  Float64 against the float64 reference of ``test_families``
(transformers' float32 casts removed): 1e-10 relative; float32 against transformers'
float32 model: 1e-5 (two float32 implementations summing in different orders).
"""

from __future__ import annotations

import numpy as np
import pytest

from support.compare import rel_err
from test_families import _hf, _hf64, _ids, _report

pytestmark = pytest.mark.slow  # transformers' models of three families
FULL_FAMILIES = ["llama3", "qwen2", "gemma3"]
TOL = {np.float64: 1e-10, np.float32: 1e-5}


def _our_grads(model, ids, dtype, backend="numpy"):
    """``(loss, {weight name: gradient})`` of the next-token loss of ``ids``, every weight
    a param as ``--fine-tune-type full`` makes them."""
    import gradtape as gt
    from gradtape import nn
    from gradtape.models.graph import head_loss, record_forward
    from gradtape.train.full import weight_params

    tp = gt.Tape(dtype, eager=False)
    W = weight_params(tp, model)
    ids = np.asarray(ids)
    hidden = record_forward(tp, model.config, W, tp.const(ids), 1, head=False)
    tid, w = (tp.const(a) for a in nn.ce_targets_fill(np.r_[ids[1:], -100]))
    loss = head_loss(tp, model.config, W, hidden, tid, w)
    grads = tp.backward(loss)
    names = list(W)
    assert set(grads) == set(W.values()), "a weight the loss does not read"
    outs = tp.compile([loss] + [grads[W[k]] for k in names], backend=backend).run()
    return float(outs[0]), dict(zip(names, outs[1:]))


def _their_grads(hf, ids):
    import torch
    hf.zero_grad()
    x = torch.tensor([ids])
    loss = torch.nn.functional.cross_entropy(hf(input_ids=x).logits[0][:-1], x[0, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in hf.named_parameters()}


def _hf_names(cfg, grads):
    """Our gradients under transformers' names and ``[out, in]`` linears, as the writer
    ``merge`` uses (``export.hf_plan``) names them, in their own dtype."""
    from gradtape.models.arch import LINEARS
    from gradtape.models.export import hf_plan

    plan = hf_plan(cfg, grads)  # one entry per weight, in the dict's order
    return {hf: (g.T if name.rsplit(".", 1)[-1] in LINEARS else g)
            for (hf, _, _), (name, g) in zip(plan, grads.items())}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("family", FULL_FAMILIES)
def test_every_weight_gradient_equals_transformers(family, dtype, folders):  # noqa: F811
    from gradtape import llama

    folder = folders(family)
    model = llama.load(folder)
    ids = _ids(model)
    hf = _hf64(folder, model.config) if dtype == np.float64 else _hf(folder)
    loss_ref, theirs = _their_grads(hf, ids)
    loss, ours = _our_grads(model, ids, dtype)
    assert loss == pytest.approx(loss_ref, rel=TOL[dtype])
    ours = _hf_names(model.config, ours)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    worst = max(rel_err(ours[n], theirs[n]) for n in theirs)
    _report(family, f"full-grad-vs-transformers-{np.dtype(dtype).name}", worst)
    assert worst <= TOL[dtype]


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_every_weight_gradient_on_the_cpu_backend_equals_numpy(family, folders):  # noqa: F811
    """The generated-C backend's full-fine-tuning gradients (the weights' own GEMMs, the
    embedding's scatter, the norms' row sums) equal the NumPy reference's (float64)."""
    from gradtape import llama

    model = llama.load(folders(family))
    ids = _ids(model)
    ref_loss, ref = _our_grads(model, ids, np.float64)
    loss, got = _our_grads(model, ids, np.float64, backend="cpu")
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    worst = max(rel_err(got[n], ref[n]) for n in ref)
    assert worst <= 1e-12, worst  # the same math, summation order aside
