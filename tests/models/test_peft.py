"""Adapters interoperate with Hugging Face PEFT, and training gradients equal PyTorch's.

On the real SmolLM2 (the session fixtures load it once): an adapter gradtape writes loads
in PEFT and gives the same logits; an adapter PEFT writes loads in gradtape and gives the
same logits; one step's adapter gradients (float64) equal PyTorch's through PEFT.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import gradtape as gt
from gradtape.llama import load_adapter
from gradtape.models.lora import PEFT_MODULES
from support.adapters import random_adapter
from support.tinymodel import lora_loss_outputs
from support.compare import rel_err

pytestmark = [pytest.mark.model, pytest.mark.slow]
TEXT = "The quick brown fox jumps over the lazy dog, then writes {\"a\": 1} in JSON."
TARGET_MODULES = [m.split(".")[1] for m in PEFT_MODULES.values()]


def _peft_logits(peft_model, ids):
    import torch
    with torch.no_grad():
        return peft_model(torch.tensor([ids])).logits[0].double().numpy()


def test_our_adapter_loads_in_peft_with_the_same_logits(smollm2, hf_smollm2, tmp_path):
    from peft import PeftModel

    ids = smollm2.tokenizer.encode(TEXT)
    ad = random_adapter(smollm2.config, b_scale=0.02, base_model=smollm2.name)
    ad.save(tmp_path / "ours")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), str(tmp_path / "ours"))
    ref = _peft_logits(peft_model.eval(), ids)
    ours = smollm2.logits(ids, adapter=ad)
    base = smollm2.logits(ids)
    assert rel_err(base, ref) > 1e-2  # the adapter really moves the logits
    assert rel_err(ours, ref) <= 1e-4


def test_peft_adapter_loads_in_gradtape_with_the_same_logits(smollm2, hf_smollm2, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=12, target_modules=TARGET_MODULES, lora_dropout=0.0,
                     task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(hf_smollm2), cfg)
    with torch.no_grad():  # PEFT starts B at zero: make it matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    ad = load_adapter(tmp_path / "theirs", smollm2)
    assert ad.rank == 4 and ad.scale == pytest.approx(3.0) and len(ad.weights) == 7 * 30
    ids = smollm2.tokenizer.encode(TEXT)
    ref = _peft_logits(peft_model.eval(), ids)
    assert rel_err(smollm2.logits(ids, adapter=ad), ref) <= 1e-4


def test_step_gradients_equal_pytorch_through_peft_float64(smollm2, hf_smollm2, hf_float64):
    """Loss and all adapter gradients of one step, float64, vs torch autograd through PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model

    ids = smollm2.tokenizer.encode(TEXT)[:14]
    ad = random_adapter(smollm2.config, rank=2, alpha=4.0, base_model=smollm2.name)
    hf = hf_float64(copy.deepcopy(hf_smollm2))
    cfg = LoraConfig(r=2, lora_alpha=4.0, target_modules=TARGET_MODULES, lora_dropout=0.0,
                     task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf, cfg).double()
    mods = dict(peft_model.named_modules())
    with torch.no_grad():
        for (layer, target), (a, b) in ad.weights.items():
            m = mods[f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"]
            m.lora_A["default"].weight.copy_(torch.tensor(a.T, dtype=torch.float64))
            m.lora_B["default"].weight.copy_(torch.tensor(b.T, dtype=torch.float64))
    x = torch.tensor([ids])
    # the mean next-token loss over T-1 targets, in float64 (transformers' own `labels=`
    # loss upcasts logits to float32, which would cap the comparison near 1e-7)
    logits_ref = peft_model(input_ids=x).logits[0]
    loss_ref = torch.nn.functional.cross_entropy(logits_ref[:-1], x[0, 1:])
    loss_ref.backward()

    tp = gt.Tape(np.float64, eager=False)
    outs, keys = lora_loss_outputs(tp, smollm2.config, smollm2.weights, ad, ids)
    outs = tp.compile(outs).run()
    assert float(outs[0]) == pytest.approx(loss_ref.item(), rel=1e-12)
    worst = 0.0
    for i, (layer, target) in enumerate(keys):
        m = mods[f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"]
        ga = m.lora_A["default"].weight.grad.numpy().T
        gb = m.lora_B["default"].weight.grad.numpy().T
        worst = max(worst, rel_err(outs[1 + 2 * i], ga), rel_err(outs[2 + 2 * i], gb))
    print(f"worst relative adapter-gradient error vs PEFT float64: {worst:.2e}")
    assert worst <= 1e-9, worst
