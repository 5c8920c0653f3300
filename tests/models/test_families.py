"""Every family of ``models.arch`` against its reference implementations.

For each family a two-layer random model made with ``transformers`` (``families.py``,
non-default options on) is saved as a Hugging Face folder, once per session.  Then:
gradtape's logits equal transformers' (float32 and float64), its tokenizer and chat
template equal transformers'; the GGUF llama.cpp's own converter makes of the folder
loads with the same logits and tokens; one LoRA step's adapter gradients equal PEFT's
in float64; a short fine-tune writes an adapter PEFT loads with gradtape's logits; the
merged model (in memory, as a Hugging Face folder read by transformers, as a GGUF) keeps
those logits; and the llama.cpp LoRA GGUF we export equals, tensor for tensor, what
llama.cpp's ``convert_lora_to_gguf.py`` makes of the same adapter.  Each test prints its
worst relative error (``FAMILY <family> <check> <error>``).

Tolerances: float32 logits 1e-5 relative to the largest logit (two float32
implementations of the same math in different orders: about 1e-6 measured); float64
1e-10 (the same math, float64 rounding only: about 1e-15 measured, against a reference
with transformers' float32 casts in RMSNorm / rope removed); adapter round trips 1e-4
(float32 adapter files).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from families import (FAMILIES, GGUF_FAMILIES, GGUF_VARIANTS, SEQ_LEN, TEXT, TEXT_SUITE,
                      converter_dir, lora_job, make_folder, model_job, run_converters,
                      spm_kind, spm_reference)
from support.adapters import random_adapter
from support.compare import rel_err
from support.greedy import assert_greedy_equal
from support.tinymodel import lora_loss_outputs

# transformers' models of every family, llama.cpp's converters in a subprocess: minutes
pytestmark = pytest.mark.slow
NAMES = list(FAMILIES)


def _report(family, check, err):
    print(f"FAMILY {family} {check} {err:.2e}")


def _need_converter():
    assert converter_dir() is not None, (
        "llama.cpp's convert_hf_to_gguf.py not found (make test extracts it into "
        ".venv/llama.cpp-convert; or set GRADTAPE_LLAMA_CPP_CONVERT)")


@pytest.fixture(scope="session")
def ggufs(folders, tmp_path_factory):
    """family -> (the float32 GGUF llama.cpp's converter makes of its folder, that folder)
    (all families converted at once, on first use); a family with options llama.cpp
    cannot describe (``GGUF_VARIANTS``) is converted from a variant folder without them."""
    _need_converter()
    root = tmp_path_factory.mktemp("families_gguf")
    src = {f: make_folder(f, root / f"{f}-variant", kw_override=GGUF_VARIANTS[f])
           if f in GGUF_VARIANTS else folders(f) for f in GGUF_FAMILIES}
    run_converters([model_job(src[f], root / f"{f}.gguf", FAMILIES[f][2])
                    for f in GGUF_FAMILIES], root)
    return {f: (root / f"{f}.gguf", src[f]) for f in GGUF_FAMILIES}


def _hf(folder, attn="eager"):
    """transformers' float32 model of ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                attn_implementation=attn).eval()


def _eager_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   softcap=None, **kwargs):
    """transformers' eager attention (soft-capping included) with the softmax kept in the
    input dtype: the float64 reference for Gemma 2, whose SDPA path cannot soft-cap and
    whose eager path computes the softmax in float32."""
    import torch
    g = module.num_key_value_groups
    k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    w = torch.matmul(query, k.transpose(2, 3)) * (scaling or module.head_dim ** -0.5)
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def _hf64(folder, cfg):
    """transformers' float64 reference of ``folder`` (see ``_float64_reference``)."""
    if not cfg.attn_softcap:
        return _float64_reference(_hf(folder, "sdpa"), cfg)
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    AttentionInterface.register("gradtape_eager64", _eager_float64)
    AttentionMaskInterface.register("gradtape_eager64", eager_mask)  # additive masks
    return _float64_reference(_hf(folder, "gradtape_eager64"), cfg)


def _ids(model):
    ids = model.tokenizer.encode(TEXT)
    return (ids * (SEQ_LEN // len(ids) + 1))[:SEQ_LEN]


def _logits(hf, ids):
    import torch
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def _float64_reference(hf, cfg):
    """transformers' model in float64 with its float32 casts removed: RMSNorm computed in
    the input dtype, rope angles from float64 frequencies, Gemma's embedding scale in
    float64; ``hf`` must use SDPA or ``_eager_float64`` attention (the eager path's
    softmax is float32).  The frequencies are gradtape's formula (``rope_tables``),
    checked first against transformers' own float32 ``inv_freq`` (llama3 scaling
    included, per layer type) so the reference keeps transformers' rope."""
    import types

    import torch

    def inv_freq(layer):
        base, factors = cfg.rope_for(layer)
        inv = base ** (-2.0 * np.arange(cfg.head_dim // 2) / cfg.head_dim)
        return torch.tensor(inv / np.asarray(factors or 1.0), dtype=torch.float64)

    # per layer type (Gemma 3: local layers have their own base), and None: the one
    # table of the families with a single rope (NoPE layers skip it)
    roped = [i for i in range(cfg.n_layers) if i not in cfg.nope_layers]
    invs = {("sliding_attention" if cfg.window(i) else "full_attention"): inv_freq(i)
            for i in roped}
    invs[None] = inv_freq(roped[0])

    def rms_forward(self, x):
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (1.0 + self.weight) if cfg.norm_plus_one else self.weight * y

    def rope_forward(self, x, position_ids, layer_type=None):
        freqs = position_ids[..., None].to(torch.float64) * invs[layer_type]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    n_rope = 0
    hf = hf.double()
    for mod in hf.modules():
        name = type(mod).__name__
        if hasattr(mod, "scalar_embed_scale"):  # Gemma's sqrt(D), a float32 buffer
            mod.embed_scale = torch.tensor(mod.scalar_embed_scale, dtype=torch.float64)
        if name.endswith("RMSNorm"):
            mod.forward = types.MethodType(rms_forward, mod)
        elif name.endswith("RotaryEmbedding"):
            for kind, inv in invs.items():
                prefix = f"{kind}_" if kind else ""
                if hasattr(mod, prefix + "inv_freq"):
                    theirs = getattr(mod, prefix + "inv_freq").double()
                    assert float((theirs - inv).abs().max() / inv.abs().max()) < 1e-6, kind
                    assert getattr(mod, prefix + "attention_scaling", 1.0) == 1.0
            mod.forward = types.MethodType(rope_forward, mod)
            n_rope += 1
    assert n_rope >= 1
    return hf


# --- HF folders -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NAMES)
def test_hf_folder_logits_equal_transformers(family, folders):
    from gradtape import llama

    folder = folders(family)
    model = llama.load(folder)
    ids = _ids(model)
    ref = _logits(_hf(folder), ids)
    err = rel_err(model.logits(ids), ref)
    _report(family, "hf-logits-f32", err)
    assert err <= 1e-5
    # the family's options matter: the same weights as plain llama give other logits
    plain = copy.copy(model)
    import dataclasses
    plain.config = dataclasses.replace(model.config, rope_factors=(), rope_linear=0.0,
                                       rope_local_base=0.0, nope_layers=(), sliding_window=0,
                                       sliding_layers=(), qk_norm=False, biases=(),
                                       attn_softcap=0.0, final_softcap=0.0)
    plain.weights = model.weights
    if plain.config != model.config:
        assert rel_err(plain.logits(ids), ref) > 1e-3

    ref64 = _logits(_hf64(folder, model.config), ids)
    err64 = rel_err(model.logits(ids, dtype=np.float64), ref64)
    _report(family, "hf-logits-f64", err64)
    assert err64 <= 1e-10


@pytest.mark.parametrize("family", NAMES)
def test_tokenizer_and_chat_template_equal_transformers(family, folders):
    from transformers import AutoTokenizer

    from gradtape import llama

    folder = folders(family)
    ours, theirs = llama.load(folder).tokenizer, AutoTokenizer.from_pretrained(str(folder))
    assert ours.encode(TEXT) == theirs(TEXT)["input_ids"]
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=False) == \
        theirs.apply_chat_template(msgs, tokenize=False)


def test_kv_cached_decoding_equals_the_full_forward(folders):
    """Generation (prompt through the KV cache, then the compiled decode step) picks the
    tokens the full forward pass's argmax picks, on the windowed, normed, fused, soft-capped,
    per-layer-rope and NoPE families, wherever its top-2 margin is over the two paths'
    float32 rounding (1e-5, the float32 logits' bound)."""
    from gradtape import llama

    for family in ("mistral", "qwen3", "phi3", "gemma2", "gemma3", "smollm3"):
        model = llama.load(folders(family))
        prompt = _ids(model)[:4]
        new = model.generate(prompt, 9, stop_ids=())
        full = model.logits(prompt + new[:-1])[len(prompt) - 1:]
        assert_greedy_equal(full, new, full.argmax(1), 1e-5)


# --- GGUF via llama.cpp's converter -----------------------------------------------------------

@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_from_llama_cpp_converter_loads_with_the_same_logits(family, ggufs, tmp_path):
    from gradtape import llama
    from gradtape.models.export import save_gguf

    path, folder = ggufs[family]
    model, ours_hf = llama.load(path), llama.load(folder)
    ids = _ids(ours_hf)
    assert model.tokenizer.encode(TEXT) == ours_hf.tokenizer.encode(TEXT)
    ref = _logits(_hf(folder), ids)
    rows = len(ids)
    if family == "mistral":
        # llama.cpp converts Mistral as the llama architecture and keeps no sliding window
        # (llama.cpp itself attends to every key); rows before the window are unaffected
        assert model.config.sliding_window == 0
        rows = FAMILIES[family][1]["sliding_window"]
    err = rel_err(model.logits(ids)[:rows], ref[:rows])
    _report(family, "gguf-logits-f32", err)
    assert err <= 1e-5
    # our GGUF writer keeps what llama.cpp's converter wrote (the vocabulary, Gemma's
    # 1 + w norms, caps, windows, rope settings)
    again = llama.load(save_gguf(model, tmp_path / "again.gguf"))
    assert again.config == model.config
    assert all(np.array_equal(again.weights[k], model.weights[k]) for k in model.weights)
    assert again.tokenizer.encode(TEXT) == model.tokenizer.encode(TEXT)


@pytest.mark.parametrize("family", [f for f in GGUF_FAMILIES if spm_kind(FAMILIES[f][2])])
def test_sentencepiece_gguf_vocabulary_encodes_as_sentencepiece(family, ggufs):
    """A sentencepiece GGUF vocabulary (``tokenizer.ggml.model = llama``: pieces, scores,
    token types, byte pieces, the dummy prefix or not) encodes the text suite (unicode,
    runs of spaces, tabs, newlines, digits, chat markers) to the ids the model's own
    ``tokenizer.model`` gives, and decodes them back to the text; so does the Hugging Face
    folder's ``tokenizer.json``."""
    import sentencepiece as spm

    from gradtape import llama

    path, folder = ggufs[family]
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ours, ours_hf = llama.load(path).tokenizer, llama.load(folder).tokenizer
    control = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)}
    for text in TEXT_SUITE:
        want = spm_reference(sp, text)
        assert ours.encode(text) == want, text
        assert ours_hf.encode(text) == want, text
        if not any(c in text for c in control):
            assert ours.decode(want[1:]) == sp.decode(want[1:]) == text, text
        assert ours.decode(want, skip_special_tokens=True) == sp.decode(want), text
    bos, eos = FAMILIES[family][3][:2]
    assert (ours.bos_id, ours.eos_id) == (sp.piece_to_id(bos), sp.piece_to_id(eos))


# --- LoRA: gradients, PEFT round trip, merge, GGUF-LoRA export --------------------------------

def _peft_targets(cfg):
    from gradtape.models.lora import PEFT_MODULES, model_targets
    return [PEFT_MODULES[t].split(".")[1] for t in model_targets(cfg)]


@pytest.mark.parametrize("family", NAMES)
def test_lora_step_gradients_equal_peft_float64(family, folders):
    import torch
    from peft import LoraConfig, get_peft_model

    import gradtape as gt
    from gradtape import llama
    from gradtape.models.lora import PEFT_MODULES

    folder = folders(family)
    model = llama.load(folder)
    ids = _ids(model)
    ad = random_adapter(model.config, rank=2, alpha=4.0, base_model=model.name)
    hf = _hf64(folder, model.config)
    peft_model = get_peft_model(hf, LoraConfig(r=ad.rank, lora_alpha=ad.alpha, lora_dropout=0.0,
                                               target_modules=_peft_targets(model.config),
                                               task_type="CAUSAL_LM")).double()
    mods = dict(peft_model.named_modules())

    def mod(layer, target):
        return mods[f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"]

    with torch.no_grad():
        for (layer, target), (a, b) in ad.weights.items():
            m = mod(layer, target)
            m.lora_A["default"].weight.copy_(torch.tensor(a.T, dtype=torch.float64))
            m.lora_B["default"].weight.copy_(torch.tensor(b.T, dtype=torch.float64))
    x = torch.tensor([ids])
    loss_ref = torch.nn.functional.cross_entropy(peft_model(input_ids=x).logits[0][:-1], x[0, 1:])
    loss_ref.backward()

    tp = gt.Tape(np.float64, eager=False)
    outs, keys = lora_loss_outputs(tp, model.config, model.weights, ad, ids)
    outs = tp.compile(outs).run()
    assert float(outs[0]) == pytest.approx(loss_ref.item(), rel=1e-12)
    worst = 0.0
    for i, (layer, target) in enumerate(keys):
        m = mod(layer, target)
        worst = max(worst, rel_err(outs[1 + 2 * i], m.lora_A["default"].weight.grad.numpy().T),
                    rel_err(outs[2 + 2 * i], m.lora_B["default"].weight.grad.numpy().T))
    _report(family, "grad-vs-peft-f64", worst)
    assert worst <= 1e-9


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2"])
def test_training_step_on_the_cpu_backend_equals_numpy(family, folders):
    """The compiled training step of each family's graph (biases, q/k norms, fused
    projections, GeGLU, soft-capping, windows) gives the same loss and adapter gradients
    on the generated-C ``cpu`` backend as on the NumPy reference (float64)."""
    import gradtape as gt
    from gradtape import llama

    model = llama.load(folders(family))
    ids = _ids(model)
    ad = random_adapter(model.config, rank=2, alpha=4.0, base_model=model.name)
    tp = gt.Tape(np.float64, eager=False)
    outs, _ = lora_loss_outputs(tp, model.config, model.weights, ad, ids)
    ref = tp.compile(outs, backend="numpy").run()
    got = tp.compile(outs, backend="cpu").run()
    worst = max(rel_err(g, r) for g, r in zip(got, ref))
    assert worst <= 1e-12, worst  # float64: the same math, summation order aside


@pytest.fixture(scope="session")
def finetuned(folders, tmp_path_factory):
    """family -> (model, adapter folder) after a short ``finetune`` on the family's folder."""
    from gradtape import llama
    from gradtape.train.finetune import FinetuneConfig, finetune

    root = tmp_path_factory.mktemp("families_ft")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"{w} {w}."}]})
        + "\n" for w in ("fox", "dog", "code", "café", "JSON", "LoRA")))
    made = {}

    def get(family):
        if family not in made:
            model = llama.load(folders(family))
            out = root / family
            finetune(FinetuneConfig(model=str(folders(family)), data=str(data), out=str(out),
                                    steps=3, seq_len=32, batch_size=2, rank=4, alpha=8.0,
                                    lr=5e-2, warmup=0, eval_frac=0.0, progress=False),
                     model=model, log=lambda *a, **k: None)
            made[family] = (model, out / "adapter")
        return made[family]
    return get


@pytest.mark.parametrize("family", NAMES)
def test_finetuned_adapter_loads_in_peft_and_merges(family, folders, finetuned, tmp_path):
    from peft import PeftModel

    from gradtape import llama
    from gradtape.models.export import merged_model, save_gguf, save_hf_folder

    model, adapter_dir = finetuned(family)
    ad = llama.load_adapter(adapter_dir, model)
    assert set(ad.targets) == set(__import__("gradtape.models.lora", fromlist=["x"])
                                  .model_targets(model.config))
    ids = _ids(model)
    ours = model.logits(ids, adapter=ad)
    assert rel_err(ours, model.logits(ids)) > 1e-3  # training moved the model
    peft_model = PeftModel.from_pretrained(_hf(folders(family)), str(adapter_dir)).eval()
    err = rel_err(ours, _logits(peft_model, ids))
    _report(family, "peft-roundtrip", err)
    assert err <= 1e-4

    merged = merged_model(model, ad)
    err_mem = rel_err(merged.logits(ids), ours)
    save_hf_folder(merged, tmp_path / "merged")
    err_hf = rel_err(_logits(_hf(tmp_path / "merged"), ids), ours)
    err_ours = rel_err(llama.load(tmp_path / "merged").logits(ids), ours)
    err_gguf = 0.0
    if family in GGUF_VARIANTS:  # Gemma's query_pre_attn_scalar != head_dim: llama.cpp has no key
        from gradtape.errors import GradtapeError
        with pytest.raises(GradtapeError, match="query_scale = 24.0 .it would be read as 16.0"):
            save_gguf(merged, tmp_path / "merged.gguf")
    else:
        save_gguf(merged, tmp_path / "merged.gguf")
        err_gguf = rel_err(llama.load(tmp_path / "merged.gguf").logits(ids), ours)
    _report(family, "merge", max(err_mem, err_hf, err_ours, err_gguf))
    assert max(err_mem, err_hf, err_ours, err_gguf) <= 1e-4


@pytest.fixture(scope="session")
def lora_ggufs(folders, finetuned, tmp_path_factory):
    """family -> the LoRA GGUF llama.cpp's ``convert_lora_to_gguf.py`` makes of the
    family's fine-tuned adapter (all families at once, on first use)."""
    _need_converter()
    root = tmp_path_factory.mktemp("families_lora_gguf")
    out = {f: root / f"{f}-lora.gguf" for f in NAMES}
    run_converters([lora_job(finetuned(f)[1], folders(f), out[f], FAMILIES[f][2])
                    for f in NAMES], root)
    return out


@pytest.mark.parametrize("family", NAMES)
def test_gguf_lora_export_equals_llama_cpp_converter(family, finetuned, lora_ggufs, tmp_path):
    """Our llama.cpp LoRA GGUF holds the tensors (names, shapes, values) and alpha that
    llama.cpp's own ``convert_lora_to_gguf.py`` writes for the same PEFT adapter."""
    from gradtape import llama
    from gradtape.formats.gguf_reader import GGUFFile
    from gradtape.models.export import save_gguf_lora

    model, adapter_dir = finetuned(family)
    ad = llama.load_adapter(adapter_dir, model)
    ours = GGUFFile(save_gguf_lora(ad, model.config, tmp_path / "ours.gguf"))
    theirs = GGUFFile(lora_ggufs[family])
    assert ours.meta["general.architecture"] == theirs.meta["general.architecture"]
    assert ours.meta["adapter.lora.alpha"] == pytest.approx(theirs.meta["adapter.lora.alpha"])
    assert set(ours.tensors) == set(theirs.tensors)
    worst = 0.0
    for name, t in theirs.tensors.items():
        a, b = np.asarray(ours.tensors[name].data), np.asarray(t.data)
        assert a.shape == b.shape, name
        worst = max(worst, rel_err(a, b))
    _report(family, "gguf-lora-export", worst)
    assert worst <= 1e-7  # float32 both sides: the same numbers (q/k rows permuted alike)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, match", [
    ({"model_type": "mixtral", "num_local_experts": 8}, "model_type 'mixtral'"),
    ({"num_experts": 8}, "num_experts = 8: mixture-of-experts"),
    ({"vision_config": {"hidden_size": 8}}, "vision_config: multimodal"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope scaling 'longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"hidden_act": "gelu"}, "hidden activation 'gelu'"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer type 'chunked_attention'"),
    ({"attention_bias": True}, "attention_bias = true is not supported for qwen2"),
])
def test_unsupported_options_are_one_clear_error(edit, match, folders, tmp_path):
    import shutil

    from gradtape import llama
    from gradtape.errors import FileFormatError

    d = tmp_path / "m"
    shutil.copytree(folders("qwen2"), d)
    cj = json.loads((d / "config.json").read_text())
    cj.pop("rope_parameters", None) if "rope_scaling" in edit else None
    cj.update(edit)
    (d / "config.json").write_text(json.dumps(cj))
    with pytest.raises(FileFormatError, match=match):
        llama.load(d)


@pytest.mark.parametrize("edit, match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e4}}},
     "rope scaling on the sliding-window layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope scaling 'yarn'"),
])
def test_unsupported_gemma3_options_are_one_clear_error(edit, match, folders, tmp_path):
    import shutil

    from gradtape import llama
    from gradtape.errors import FileFormatError

    d = tmp_path / "m"
    shutil.copytree(folders("gemma3"), d)
    cj = json.loads((d / "config.json").read_text())
    cj.update(edit)
    (d / "config.json").write_text(json.dumps(cj))
    with pytest.raises(FileFormatError, match=match):
        llama.load(d)


def test_gemma3_text_tower_of_a_multimodal_checkpoint(folders, tmp_path):
    """A Gemma3ForConditionalGeneration folder (vision tower, projector, the language
    model under ``model.language_model``) loads as its text model, with the logits
    transformers' multimodal model gives on text alone."""
    import dataclasses

    import torch
    import transformers

    from gradtape import llama
    from gradtape.errors import FileFormatError

    text = transformers.AutoConfig.from_pretrained(str(folders("gemma3")))
    text.final_logit_softcapping = None  # (the multimodal model never applies it)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=4, image_token_index=text.vocab_size - 1)
    torch.manual_seed(0)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(_hf(folders("gemma3")).model.state_dict())
    mm.save_pretrained(str(tmp_path / "mm"))
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (tmp_path / "mm" / f).write_bytes((folders("gemma3") / f).read_bytes())
    model = llama.load(tmp_path / "mm")
    want = dataclasses.replace(llama.load(folders("gemma3")).config, final_softcap=0.0)
    assert model.config == want
    ids = _ids(model)
    err = rel_err(model.logits(ids), _logits(mm, ids))
    _report("gemma3", "multimodal-text-logits-f32", err)
    assert err <= 1e-5
    cj = json.loads((tmp_path / "mm" / "config.json").read_text())
    cj["text_config"]["final_logit_softcapping"] = 30.0
    (tmp_path / "mm" / "config.json").write_text(json.dumps(cj))
    with pytest.raises(FileFormatError, match="final_logit_softcapping in the text_config"):
        llama.load(tmp_path / "mm")


def _meta(arch="qwen2", **extra):
    m = {"general.architecture": arch, f"{arch}.embedding_length": 32, f"{arch}.block_count": 2,
         f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
         f"{arch}.feed_forward_length": 48, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    m.update({f"{arch}.{k}": v for k, v in extra.items()})
    return m


@pytest.mark.parametrize("meta, match", [
    (_meta("qwen2moe"), "architecture 'qwen2moe' is not supported"),
    (_meta("qwen2", expert_count=8), "qwen2.expert_count = 8: mixture-of-experts"),
    (_meta("llama", **{"rope.scaling.type": "yarn"}), "rope scaling 'yarn'"),
    (_meta("phi3", **{"rope.dimension_count": 4}), "partial rope"),
    ({k: v for k, v in _meta("qwen3").items() if "epsilon" not in k},
     "missing GGUF metadata key 'qwen3.attention.layer_norm_rms_epsilon'"),
])
def test_unsupported_gguf_metadata_is_one_clear_error(meta, match):
    from gradtape.errors import FileFormatError
    from gradtape.models.config import from_gguf_metadata
    with pytest.raises(FileFormatError, match=match):
        from_gguf_metadata(meta, "x.gguf", 100, tied=True)


def test_gguf_metadata_of_each_family():
    """Features come from the family, the metadata and the tensor names."""
    from gradtape.models.config import from_gguf_metadata
    names = ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias", "blk.0.attn_q.weight"]
    c = from_gguf_metadata(_meta("qwen2"), "x", 100, True, names=names)
    assert (c.arch, c.biases, c.qk_norm, c.fused) == ("qwen2", ("q", "k", "v"), False, False)
    c = from_gguf_metadata(_meta("qwen3", **{"attention.key_length": 16,
                                              "attention.value_length": 16}), "x", 100, False,
                           names=["blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"])
    assert (c.arch, c.head_dim, c.qk_norm, c.biases) == ("qwen3", 16, True, ())
    c = from_gguf_metadata(_meta("phi3", **{"attention.sliding_window": 7}), "x", 100, False)
    assert (c.arch, c.fused, c.window(0), c.window(1)) == ("phi3", True, 7, 7)
    c = from_gguf_metadata(_meta("gemma2", **{"attention.sliding_window": 5,
                                               "attn_logit_softcapping": 50.0,
                                               "final_logit_softcapping": 30.0}), "x", 100, True)
    assert (c.window(0), c.window(1), c.attn_softcap, c.final_softcap, c.act) == \
        (5, 0, 50.0, 30.0, "gelu_tanh")
    f = (1.0, 2.0, 4.0, 8.0)
    c = from_gguf_metadata(_meta("llama"), "x", 100, True, rope_factors=f)
    assert c.rope_factors == f and c.arch == "llama"
    # Gemma 3: llama.cpp's fixed pattern (every 6th layer global), the local rope base
    # 10k unless the file says, linear scaling on the global layers, head_dim's scale
    # (dim / n_heads for the 62-layer 27B)
    g3 = {"block_count": 8, "attention.sliding_window": 5, "rope.freq_base": 1e6,
          "rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
          "attention.key_length": 16, "attention.value_length": 16}
    c = from_gguf_metadata(_meta("gemma3", **g3), "x", 100, True)
    assert (c.sliding_layers, c.window(5), c.rope_local_base, c.query_scale) == \
        ((0, 1, 2, 3, 4, 6, 7), 0, 10000.0, 16.0)
    assert c.rope_for(0) == (10000.0, None) and c.rope_for(5) == (1e6, (8.0,) * 8)
    c = from_gguf_metadata(_meta("gemma3", **g3, **{"rope.freq_base_swa": 5e4,
                                                     "attention.sliding_window_pattern": 2}),
                           "x", 100, True)
    assert (c.sliding_layers, c.rope_local_base) == ((0, 2, 4, 6), 5e4)
    c = from_gguf_metadata(_meta("gemma3", **dict(g3, block_count=62)), "x", 100, True)
    assert c.query_scale == 32 / 4
    # SmolLM3: no rope on every 4th layer (llama.cpp's fixed step)
    c = from_gguf_metadata(_meta("smollm3", block_count=8), "x", 100, True)
    assert c.nope_layers == (3, 7) and c.rope_for(3) is None and c.rope_for(2) == (10000.0, None)
