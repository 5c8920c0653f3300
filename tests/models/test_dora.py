"""DoRA and rsLoRA against PEFT, on small random models of four families (Phi-3's fused
qkv / gate_up projections among them).

The same batch through PEFT (``use_dora=True``, ``use_rslora``) and through gradtape's
graph (``nn.dora_linear``): the loss and every adapter gradient (A, B and the magnitude)
equal, in float64 (1e-10 relative: the same math, float64 rounding only) and float32
(1e-5 relative to each gradient's largest element: two float32 implementations summing
in different orders); a PEFT DoRA or rsLoRA adapter folder loads here with PEFT's logits
(1e-5, float32).  Then the pieces that need no PEFT: the rank-r column norm equals the
dense one, and on a weight kept in its ggml blocks equals it on the dequantized weight.
"""

from __future__ import annotations

import numpy as np
import pytest

from families import make_folder
from support.adapters import random_dora_adapter
from support.compare import rel_err
from support.tinymodel import lora_loss_outputs
from test_families import _hf, _hf64, _ids, _logits, _peft_targets

pytestmark = pytest.mark.slow  # transformers and PEFT models of four families
FAMILIES = ["llama3", "qwen2", "gemma3", "phi3"]


def _peft(hf, ad, cfg, dtype):
    """PEFT's DoRA model over ``hf`` holding ``ad``'s A, B and magnitudes."""
    import torch
    from peft import LoraConfig, get_peft_model

    from gradtape.models.lora import PEFT_MODULES

    pm = get_peft_model(hf, LoraConfig(r=ad.rank, lora_alpha=ad.alpha, lora_dropout=0.0,
                                       target_modules=_peft_targets(cfg), use_dora=True,
                                       use_rslora=ad.scale_override is not None,
                                       task_type="CAUSAL_LM")).to(dtype)
    mods = dict(pm.named_modules())
    by_key = {}
    with torch.no_grad():
        for key, (a, b) in ad.weights.items():
            m = mods[f"base_model.model.model.layers.{key[0]}.{PEFT_MODULES[key[1]]}"]
            m.lora_A["default"].weight.copy_(torch.tensor(a.T, dtype=dtype))
            m.lora_B["default"].weight.copy_(torch.tensor(b.T, dtype=dtype))
            m.lora_magnitude_vector["default"].weight.copy_(
                torch.tensor(ad.magnitudes[key], dtype=dtype))
            by_key[key] = m
    return pm, by_key


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dora_gradients_equal_peft(family, dtype, folders):
    import torch

    import gradtape as gt
    from gradtape import llama

    folder = folders(family)
    model = llama.load(folder)
    ids = _ids(model)
    # rsLoRA's scale on one family: the scale enters the norm as well as the update
    ad = random_dora_adapter(model.config, model.weights, rank=2, alpha=4.0,
                             rslora=family == "qwen2")
    tdt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    hf = _hf64(folder, model.config) if dtype == "float64" else _hf(folder)
    pm, mods = _peft(hf, ad, model.config, tdt)
    x = torch.tensor([ids])
    loss_ref = torch.nn.functional.cross_entropy(pm(input_ids=x).logits[0][:-1], x[0, 1:])
    loss_ref.backward()

    tp = gt.Tape(np.dtype(dtype), eager=False)
    outs, keys = lora_loss_outputs(tp, model.config, model.weights, ad, ids)
    outs = tp.compile(outs).run()
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert float(outs[0]) == pytest.approx(loss_ref.item(), rel=tol)
    worst = 0.0
    for i, key in enumerate(keys):
        m = mods[key]
        ref = (m.lora_A["default"].weight.grad.numpy().T, m.lora_B["default"].weight.grad.numpy().T,
               m.lora_magnitude_vector["default"].weight.grad.numpy())
        worst = max(worst, *(rel_err(outs[1 + 3 * i + j], ref[j]) for j in range(3)))
    print(f"FAMILY {family} dora-grad-vs-peft-{dtype} {worst:.2e}")
    assert worst <= tol


@pytest.mark.parametrize("kind", ["dora", "rslora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_folder_loads_with_peft_logits(family, kind, folders, tmp_path):
    import torch

    from gradtape import llama

    folder = folders(family)
    model = llama.load(folder)
    ids = _ids(model)
    ad = random_dora_adapter(model.config, model.weights, rank=2, alpha=4.0, b_scale=0.2,
                             rslora=kind == "rslora")
    pm, _ = _peft(_hf(folder), ad, model.config, torch.float32)
    if kind == "rslora":  # a plain rsLoRA adapter: PEFT without DoRA
        from peft import LoraConfig, get_peft_model
        from gradtape.models.lora import PEFT_MODULES
        pm = get_peft_model(_hf(folder), LoraConfig(
            r=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=_peft_targets(model.config),
            use_rslora=True, task_type="CAUSAL_LM"))
        mods = dict(pm.named_modules())
        with torch.no_grad():
            for (layer, target), (a, b) in ad.weights.items():
                m = mods[f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"]
                m.lora_A["default"].weight.copy_(torch.tensor(a.T))
                m.lora_B["default"].weight.copy_(torch.tensor(b.T))
    pm.eval().save_pretrained(str(tmp_path / "adapter"))
    theirs = _logits(pm, ids)
    loaded = llama.load_adapter(tmp_path / "adapter", model)
    assert loaded.dora == (kind == "dora")
    assert loaded.scale == pytest.approx(4.0 / np.sqrt(2) if kind == "rslora" else 2.0)
    ours = model.logits(ids, adapter=loaded)
    assert rel_err(ours, model.logits(ids)) > 1e-3  # the adapter moves the model
    err = rel_err(ours, theirs)
    print(f"FAMILY {family} {kind}-peft-logits {err:.2e}")
    assert err <= 1e-5


def test_our_dora_folder_loads_in_peft(folders, tmp_path):
    """What ``LoraAdapter.save`` writes for DoRA is what PEFT reads: the same logits."""
    from peft import PeftModel

    from gradtape import llama
    from gradtape.models.lora import PEFT_MODULES

    folder = folders("llama3")
    model = llama.load(folder)
    ids = _ids(model)
    ad = random_dora_adapter(model.config, model.weights, rank=2, alpha=4.0, b_scale=0.2)
    ad.save(tmp_path / "adapter")
    pm = PeftModel.from_pretrained(_hf(folder), str(tmp_path / "adapter")).eval()
    assert rel_err(model.logits(ids, adapter=ad), _logits(pm, ids)) <= 1e-5
    # merge folds DoRA in as PEFT's merge_and_unload does
    from gradtape.models.export import merge
    theirs = dict(pm.merge_and_unload().named_parameters())
    ours = merge(model.weights, ad)
    for (layer, target) in ad.weights:
        name = f"model.layers.{layer}.{PEFT_MODULES[target]}.weight"
        assert rel_err(ours[f"layers.{layer}.{target}"].T, theirs[name].detach().numpy()) <= 1e-6


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_c_decode_engine_runs_dora_on_fused_and_post_norm_families(family, tmp_path):
    """Phi-3's fused linears (the factor split with B's columns) and Gemma 3's norms
    after attention and MLP (the scaled rows before the post-norm) in the C engine."""
    from families import C_DECODE_KW
    from test_dora_parts import c_engine_vs_graph

    from gradtape import llama

    model = llama.load(make_folder(family, tmp_path / family, kw_override=C_DECODE_KW))
    ad = random_dora_adapter(model.config, model.weights, rank=2, b_scale=0.2)
    ours, ref = c_engine_vs_graph(model, ad, [3, 1, 4, 1, 5], [9, 2, 6])
    assert rel_err(ours, ref) < 1e-5
