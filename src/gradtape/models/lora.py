"""LoRA and DoRA adapters: initialisation, and the PEFT file format on disk.

An adapter holds, for each (layer, target) it adapts, ``A[in, r]`` and ``B[r, out]`` in
our ``[in, out]`` orientation; the adapted linear is ``x @ w0 + s * (x @ A) @ B`` with
``s = alpha/r`` (``alpha/sqrt(r)`` under rsLoRA).  A DoRA adapter also holds a magnitude
``m [out]`` per (layer, target) (``models.dora``).  On disk it is exactly what Hugging
Face PEFT writes (``adapter_config.json`` and ``adapter_model.safetensors`` with
torch-orientation ``lora_A.weight [r, in]``, ``lora_B.weight [out, r]`` and, for DoRA,
``lora_magnitude_vector [out]``), so PEFT loads ours and we load PEFT's.  Files are
written atomically and read only through safetensors (never pickle).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import checks
from ..errors import FileFormatError, GradtapeError
from ..io import atomic_write_bytes, atomic_write_json
from .arch import ARCHS, TARGETS
from .dora import init_magnitudes

# our target name -> PEFT / Hugging Face module path inside a decoder layer
PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj", "qkv": "self_attn.qkv_proj",
                "gate_up": "mlp.gate_up_proj"}
_ORDER = TARGETS + ("qkv", "gate_up")
_MODULE_TO_TARGET = {m.split(".")[1]: t for t, m in PEFT_MODULES.items()}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_(?:([AB])(?:\.default)?\.weight|"
                  r"(magnitude_vector)(?:\.default)?(?:\.weight)?)$")
# the fine-tune types an adapter can be (``--fine-tune-type``)
ADAPTER_TYPES = ("lora", "dora")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def target_dims(cfg, target):
    """(in, out) of a target linear in a model with config ``cfg``."""
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (cfg.dim, q_out), "k": (cfg.dim, kv_out), "v": (cfg.dim, kv_out),
            "o": (q_out, cfg.dim), "gate": (cfg.dim, cfg.ffn_dim),
            "up": (cfg.dim, cfg.ffn_dim), "down": (cfg.ffn_dim, cfg.dim),
            "qkv": (cfg.dim, q_out + 2 * kv_out),
            "gate_up": (cfg.dim, 2 * cfg.ffn_dim)}[target]


def model_targets(cfg=None) -> tuple:
    """The linears a model with config ``cfg`` can adapt: its family's (``models.arch``;
    the fused ones for Phi-3)."""
    return TARGETS if cfg is None else ARCHS[cfg.arch].lora_targets


def parse_targets(spec, cfg=None, family=None):
    """'q,v' or ['q', 'v'] or 'all' -> a tuple in canonical order; PEFT names accepted.
    With ``cfg`` (or a ``family`` of ``models.arch``), the names are checked against that
    model's linears (Phi-3's fused ``qkv`` / ``gate_up``); 'all' means all of them."""
    valid = ARCHS[family].lora_targets if family else model_targets(cfg)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = set()
    for item in (i.strip() for i in items):
        if item == "all":
            names.update(valid)
            continue
        name = _MODULE_TO_TARGET.get(item, item)
        if name not in valid:
            why = ""
            if name in PEFT_MODULES:
                fused = "qkv" in valid
                why = f" (this model's projections are {'fused' if fused else 'separate'})"
            raise GradtapeError(f"unknown LoRA target {item!r}{why}; choose from "
                                f"{', '.join(valid)} (or all)")
        names.add(name)
    if not names:
        raise GradtapeError("no LoRA targets given")
    return tuple(t for t in _ORDER if t in names)


@dataclass
class LoraAdapter:
    rank: int
    alpha: float
    targets: tuple
    weights: dict  # (layer, target) -> (A [in, r], B [r, out]), float32 or float64
    base_model: str = ""
    extra_config: dict = field(default_factory=dict)  # PEFT fields we keep on a round trip
    scale_override: float | None = None  # rsLoRA: alpha / sqrt(r)
    magnitudes: dict = field(default_factory=dict)  # DoRA: (layer, target) -> m [out]

    @property
    def dora(self) -> bool:
        """Whether this is a DoRA adapter (a magnitude per adapted linear)."""
        return bool(self.magnitudes)

    @property
    def scale(self) -> float:
        return self.scale_override if self.scale_override is not None else self.alpha / self.rank

    def save(self, folder):
        """Write PEFT's format into ``folder`` (created if needed), atomically per file."""
        from safetensors.numpy import save

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for (layer, target), (a, b) in sorted(self.weights.items()):
            prefix = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T, dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T, dtype=np.float32)
            if (layer, target) in self.magnitudes:
                tensors[f"{prefix}.lora_magnitude_vector"] = np.ascontiguousarray(
                    self.magnitudes[(layer, target)], dtype=np.float32)
        atomic_write_bytes(folder / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
        atomic_write_json(folder / CONFIG_FILE, self.peft_config())

    def peft_config(self) -> dict:
        cfg = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model, "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": [PEFT_MODULES[t].split(".")[1] for t in self.targets],
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": self.scale_override is not None, "use_dora": self.dora,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None,
        }
        return {**self.extra_config, **cfg}


def init_adapter(cfg, rank=8, alpha=16.0, targets="all", seed=0, base_model="",
                 dtype=np.float32, *, rslora=False, fine_tune_type="lora", weights=None):
    """A fresh adapter as PEFT initialises one: ``A`` kaiming-uniform (a = sqrt(5), so
    ``U(-1/sqrt(in), 1/sqrt(in))``), ``B`` zero, so the adapted model starts equal to the
    base model.  Seeded: the same seed gives the same adapter.  ``rslora``: scale
    ``alpha / sqrt(rank)``; ``fine_tune_type="dora"``: magnitudes ``||w0_j||`` from the
    model's ``weights`` (``models.dora.init_magnitudes``)."""
    if fine_tune_type not in ADAPTER_TYPES:
        raise GradtapeError(f"fine-tune type {fine_tune_type!r} makes no adapter; choose "
                            f"from {', '.join(ADAPTER_TYPES)}")
    if fine_tune_type == "dora" and weights is None:
        raise GradtapeError("init_adapter: a DoRA adapter needs the model's weights")
    if rank < 1:
        raise GradtapeError(f"LoRA rank must be >= 1, got {rank}")
    targets = parse_targets(targets, cfg)
    rng = np.random.default_rng(seed)
    ab = {}
    for layer in range(cfg.n_layers):
        for t in targets:
            fan_in, fan_out = target_dims(cfg, t)
            bound = 1.0 / math.sqrt(fan_in)
            a = rng.uniform(-bound, bound, size=(rank, fan_in)).T.astype(dtype)  # [in, r]
            ab[(layer, t)] = (np.ascontiguousarray(a), np.zeros((rank, fan_out), dtype))
    mags = init_magnitudes(weights, ab, dtype) if fine_tune_type == "dora" else {}
    return LoraAdapter(rank, float(alpha), targets, ab, base_model,
                       scale_override=alpha / math.sqrt(rank) if rslora else None,
                       magnitudes=mags)


def load_adapter(folder, model=None) -> LoraAdapter:
    """Read a PEFT LoRA folder (ours or Hugging Face's; DoRA with ``use_dora``, rsLoRA
    with ``use_rslora``).  With ``model``, check that every tensor fits that model's
    shapes and name the first that does not."""
    from ..formats.safetensors_reader import read_safetensors

    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise GradtapeError(f"{folder}: not a LoRA adapter folder ({p.name} is missing)")
    try:
        pcfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FileFormatError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(pcfg, dict) or pcfg.get("peft_type", "LORA") != "LORA":
        raise FileFormatError(f"{cfg_path}: not a LoRA adapter config")
    try:
        rank, alpha = pcfg["r"], float(pcfg.get("lora_alpha", pcfg["r"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise FileFormatError(f"{cfg_path}: needs integer 'r' and numeric 'lora_alpha'") from None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 1 << 16:
        raise FileFormatError(f"{cfg_path}: r = {rank!r} is not a LoRA rank (an integer >= 1)")
    if not math.isfinite(alpha):
        raise FileFormatError(f"{cfg_path}: lora_alpha = {alpha!r} is not a finite number")
    dora = bool(pcfg.get("use_dora"))
    if pcfg.get("rank_pattern") or pcfg.get("alpha_pattern"):
        raise FileFormatError(f"{cfg_path}: per-module rank/alpha patterns are not supported")
    tensors, _ = read_safetensors(w_path)  # every size checked; FileFormatError if bad

    parts = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _MODULE_TO_TARGET:
            raise FileFormatError(f"{w_path}: unexpected tensor {key!r} (only LoRA A/B "
                                  f"{'and DoRA magnitudes ' if dora else ''}of "
                                  f"{', '.join(sorted(_MODULE_TO_TARGET))} are supported)")
        part = m.group(4) or "m"
        if part == "m" and not dora:
            raise FileFormatError(f"{w_path}: tensor {key} is a DoRA magnitude, but "
                                  f"{CONFIG_FILE} does not say use_dora")
        if arr.ndim != (1 if part == "m" else 2):
            raise FileFormatError(f"{w_path}: tensor {key} is not {1 if part == 'm' else 2}-d: "
                                  f"{list(arr.shape)}")
        layer, target = int(m.group(1)), _MODULE_TO_TARGET[m.group(3)]
        parts.setdefault((layer, target), {})[part] = arr.astype(np.float32).T
    weights, mags = {}, {}
    want = {"A", "B", "m"} if dora else {"A", "B"}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != want:
            raise FileFormatError(f"{w_path}: layer {layer} {target} lacks "
                                  + ", ".join("lora_magnitude_vector" if k == "m" else
                                              f"lora_{k}" for k in sorted(want - set(ab))))
        a, b = ab["A"], ab["B"]  # [in, r], [r, out]
        if a.shape[1] != rank or b.shape[0] != rank:
            raise FileFormatError(f"{w_path}: layer {layer} {target}: A {list(a.shape)} / B "
                                  f"{list(b.shape)} do not match rank {rank}")
        if dora and ab["m"].shape != (b.shape[1],):
            raise FileFormatError(f"{w_path}: layer {layer} {target}: magnitude "
                                  f"{list(ab['m'].shape)} does not match B's {b.shape[1]} "
                                  "output features")
        weights[(layer, target)] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
        if dora:
            mags[(layer, target)] = np.ascontiguousarray(ab["m"])
    if not weights:
        raise FileFormatError(f"{w_path}: holds no LoRA tensors")
    targets = tuple(t for t in _ORDER if any(k[1] == t for k in weights))
    scale = alpha / math.sqrt(rank) if pcfg.get("use_rslora") else None
    adapter = LoraAdapter(rank, alpha, targets, weights, str(pcfg.get("base_model_name_or_path")
                                                             or ""), dict(pcfg), scale, mags)
    if model is not None:
        check_adapter_fits(adapter, model.config, str(folder))
    return adapter


def check_folder(path, name="--adapter") -> Path:
    """A PEFT LoRA folder given as option ``name``: a readable folder holding
    adapter_config.json and adapter_model.safetensors (their contents are checked when
    ``load_adapter`` reads them)."""
    folder = checks.input_path(path, name, "folder")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).exists():
            raise GradtapeError(f"{name} {folder}: not a LoRA adapter folder ({f} is missing)")
        checks.input_path(folder / f, name, "file")
    return folder


def check_adapter_fits(adapter, cfg, where="adapter"):
    """Raise a clear error when an adapter was made for another base model."""
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        if target not in model_targets(cfg):
            raise GradtapeError(f"{where}: LoRA target {PEFT_MODULES.get(target, target)!r} "
                                f"in layer {layer} is not a linear of this {cfg.arch} model "
                                "(adapter made for another model?)")
        name = f"layers.{layer}.{PEFT_MODULES[target]}"
        if not 0 <= layer < cfg.n_layers:
            raise GradtapeError(f"{where}: tensor {name} is for layer {layer}, but the model "
                                f"has {cfg.n_layers} layers (adapter made for another model?)")
        fan_in, fan_out = target_dims(cfg, target)
        want_a, want_b = (fan_in, adapter.rank), (adapter.rank, fan_out)
        if a.shape != want_a or b.shape != want_b:
            raise GradtapeError(
                f"{where}: tensor {name} does not fit this model: adapter has lora_A "
                f"{list(a.T.shape)} and lora_B {list(b.T.shape)}, the model needs lora_A "
                f"{[want_a[1], want_a[0]]} and lora_B {[want_b[1], want_b[0]]} (adapter "
                "trained for another base model?)")
        m = adapter.magnitudes.get((layer, target))
        if m is not None and np.shape(m) != (fan_out,):
            raise GradtapeError(f"{where}: tensor {name}.lora_magnitude_vector has shape "
                                f"{list(np.shape(m))}, the model needs [{fan_out}]")
