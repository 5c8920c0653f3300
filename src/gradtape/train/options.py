"""Every option of a fine-tuning run, defined once: ``FinetuneConfig``.

Each field carries its default, its help text and its range check; the CLI's flags
(``cli/finetune.py``) and the config file's keys (``config_file``) are generated from
them, and ``__post_init__`` checks the options against each other (a method's options, a
fine-tune type's), so a mistake is one line naming the flag wherever it came from.
Not here: what a run does with them (``finetune``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from .. import checks
from ..backends import BACKENDS
from ..plan import COMPUTE_CHOICES, DEFAULT_COMPUTE
from ..errors import GradtapeError
from . import config_file, full, steering
from .methods import METHODS, Options, check_options, method as method_row
from .records import check_columns
from .step import GRAD_CHECKPOINT
from ..models.arch import ARCHS
from ..models.lora import check_folder, parse_targets
from ..models.memory import WEIGHT_MODES


def _opt(default, help, check=None, **kw):
    """A config field with its help text and its valid range (a ``checks.Check``, or a
    function ``(name, value)`` raising ``GradtapeError``): the CLI's option and the
    dataclass's validation are both built from it."""
    return field(default=default, metadata={"help": help, "check": check, **kw})


def _known_targets(name, value):
    """Names some family has (the model, loaded later, checks its own: Phi-3's are fused)."""
    checks.check_type(name, value, str)
    try:
        parse_targets(value)
    except GradtapeError as e:
        for family in ARCHS:
            try:
                parse_targets(value, family=family)
                return
            except GradtapeError:
                pass
        raise GradtapeError(f"{name}: {e}") from None


def _adapter_dir(name, value):
    """``""`` (a fresh adapter) or a PEFT LoRA folder (its tensors are checked against
    the model once it is loaded)."""
    checks.check_type(name, value, str)
    if value:
        check_folder(value, name)


def _default_or_positive(name, value):
    """``None`` (a default that depends on other options: the method's beta, the method's
    and fine-tune type's learning rate) or a finite number > 0."""
    if value is not None:
        checks.positive()(name, value)


# the peak learning rate where --lr is not given, by the method's data and what is
# trained.  An adapter's SFT learns a task in tens of steps at 1e-3; preference tuning at
# that rate drives the log-ratios apart until the answers degenerate, so it takes a rate
# 20x lower (TRL's own defaults keep that ratio: 2e-5 and 1e-6), and every weight trains
# at TRL's defaults.
DEFAULT_LR = {("sft", "adapter"): 1e-3, ("preference", "adapter"): 5e-5,
              ("sft", "full"): 2e-5, ("preference", "full"): 1e-6}


def _gguf_precision(name, value):
    """Empty (no GGUF) or the precision of its matrices."""
    checks.check_type(name, value, str)
    if value:
        checks.one_of("float32", "float16")(name, value)


def flag(field_name):
    """The command-line spelling of a config field: ``seq_len`` -> ``--seq-len``."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class FinetuneConfig:
    model: str = _opt("smollm2", "base model: 'smollm2' (embedded), a .gguf file or a "
                                 "Hugging Face folder", path=True)
    data: str = _opt("", "training data: a .jsonl, .json or .parquet file of OpenAI chat "
                         "(messages), ShareGPT (conversations), Alpaca (instruction, input, "
                         "output), prompt/completion or text records; a dataset folder (its "
                         "train split); or plain text", required=True, path=True)
    eval_data: str = _opt("", "held-out data, in any --data format: a file, or a dataset "
                              "folder's validation (else test) split; default: --eval-frac "
                              "of --data", path=True)
    columns: str = _opt("", "map other field names onto the schema's, FIELD=COLUMN,... "
                            "(e.g. prompt=question,completion=answer)",
                        check_columns)
    packing: bool = _opt(True, "examples are packed into --seq-len rows, best fit, each "
                               "attending only to itself with positions from 0; "
                               "--no-packing: one example a row, padded")
    train_on_prompt: bool = _opt(False, "train on every token, the prompt's too (default: "
                                        "only the answers / assistant turns)")
    out: str = _opt("", "output folder (adapter, checkpoint, log.jsonl, loss.png)",
                    required=True, path=True)
    steps: int = _opt(0, "optimizer steps (0: derive from --epochs)", checks.count(0))
    epochs: float = _opt(1.0, "passes over the training split when --steps is 0",
                         checks.positive())
    # a target is the next token: a sequence needs two positions to have one
    seq_len: int = _opt(256, "tokens per row (longer examples are truncated, text continues "
                             "into the next row)",
                        checks.count(2))
    batch_size: int = _opt(4, "sequences per micro-batch", checks.count(1))
    grad_accum: int = _opt(1, "micro-batches per optimizer step (weighted by token count)",
                           checks.count(1))
    fine_tune_type: str = _opt("lora", "what is trained: lora (a rank-r update A, B per "
                                       "target, written to adapter/), dora (LoRA plus a "
                                       "magnitude per output feature, the direction W0 + s B A "
                                       "normalised per feature, as PEFT's use_dora; often "
                                       "better at low rank, a step costs a little more) or "
                                       "full (every weight, norms and embeddings too, in "
                                       "float32 with AdamW; the trained model is written to "
                                       "model/ as a Hugging Face folder; needs about 6 float32 "
                                       "copies of the weights plus activations, checked "
                                       "before loading)",
                               checks.one_of(*full.FINE_TUNE_TYPES))
    save_gguf: str = _opt("", "full: also write the trained model as model.gguf in this "
                              "precision, float32 or float16 (for llama.cpp)",
                          _gguf_precision)
    rank: int = _opt(8, "LoRA rank r", checks.count(1))
    alpha: float = _opt(16.0, "LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with "
                              "--rslora)", checks.positive())
    rslora: bool = _opt(False, "rank-stabilised LoRA (PEFT's use_rslora): scale alpha / "
                               "sqrt(r), so higher ranks keep learning at the same --lr")
    targets: str = _opt("all", "comma-separated LoRA targets among q,k,v,o,gate,up,down "
                        "(Phi-3: qkv,o,gate_up,down)", _known_targets)
    adapter: str = _opt("", "start from this PEFT LoRA adapter folder (ours, or one PEFT "
                            "wrote) instead of a fresh adapter, with any --method: its "
                            "rank, alpha, targets and scale (rsLoRA) become the run's, so "
                            "--rank, --alpha and --targets left at their defaults follow "
                            "it and any other value is an error; for dpo and ipo the "
                            "model with this adapter is the reference", _adapter_dir,
                        path=True)
    lr: float | None = _opt(None, "peak learning rate (default: by method and fine-tune "
                                  "type: 1e-3 for an adapter's sft, 5e-5 for its preference "
                                  "tuning; with --fine-tune-type full 2e-5 and 1e-6, "
                                  "TRL's defaults)", _default_or_positive, kind=float)
    warmup: int = _opt(10, "linear warmup steps (then cosine decay to 10%% of --lr)",
                       checks.count(0))
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay", checks.nonnegative())
    clip: float = _opt(1.0, "clip gradients to this global norm (0: off)", checks.nonnegative())
    eval_frac: float = _opt(0.1, "fraction of examples held out for the eval loss (when no "
                                 "--eval-data)",
                            checks.fraction())
    eval_every: int = _opt(20, "evaluate the held-out loss every N steps (0: only at the end)",
                           checks.count(0))
    save_every: int = _opt(50, "write a checkpoint every N steps", checks.count(1))
    seed: int = _opt(0, "seed for the adapter init, the split and the batch order",
                     checks.count(0))
    backend: str = _opt("cpu", "execution backend: cpu (generated C + BLAS; falls back to "
                               "numpy, with a warning, without a C compiler) or numpy "
                               "(the reference)", checks.one_of(*BACKENDS))
    weights: str = _opt("auto", "frozen weights: float32 (dequantized at load), stored (kept "
                                "in the file's own type -- Q4_K, Q8_0, bf16 ... -- memory-"
                                "mapped, dequantized tile by tile in the matmuls) or auto "
                                "(stored when the float32 copy would leave less than a "
                                "fifth of the available memory, with --compute int8, or "
                                "where a GGUF's products run in bf16: they read bf16 "
                                "copies made from its blocks, no float32 copy is kept)",
                        checks.one_of(*WEIGHT_MODES))
    ignore_memory: bool = _opt(False, "start even when the memory estimate exceeds what is "
                                      "available")
    dtype: str = _opt("float32", "float32 or float64", checks.one_of("float32", "float64"))
    compute: str = _opt(DEFAULT_COMPUTE, "precision of the frozen-weight GEMMs (with "
                                "--fine-tune-type full: every weight's, each converted once "
                                "a step, and the weight gradients'): auto (bf16 where this "
                                "CPU runs it faster, measured once at the model's shapes, "
                                "else float32), float32, bf16 (bf16 inputs, float32 "
                                "accumulation; where not faster: a notice and float32), or "
                                "int8 (bf16, and the GEMMs against a quantized GGUF's "
                                "weights in int8 with per-row scales: faster where the CPU "
                                "has AVX512-VNNI or AMX; not exact: see docs/benchmarks.md)",
                        checks.one_of(*COMPUTE_CHOICES))
    grad_checkpoint: str = _opt("auto", "activation checkpointing, which recomputes a "
                                        "layer's forward in backward (about one more "
                                        "forward pass of it) to keep only its input rows: "
                                        "auto (every layer where that frees 1/4 of the "
                                        "run's memory, or any memory beside a trained "
                                        "state of half the run (full fine-tuning: then "
                                        "the fewest layers that free as much), at >= 1 MB "
                                        "per GFLOP recomputed; else as few as keep the "
                                        "activations within 1/3 of the run and the run "
                                        "within 3/4 of the available memory); fit (only "
                                        "as few as keep the run within 3/4 of the "
                                        "available memory: the fastest step that fits); "
                                        "on (every layer); off",
                                checks.one_of(*GRAD_CHECKPOINT))
    method: str = _opt("sft", "training method: sft (next-token loss on the answers) or a "
                              "preference method on pairs (prompt, chosen, rejected): dpo, "
                              "ipo (both against the starting model, a reference pass "
                              "before the first step), orpo, simpo (no reference); as "
                              "TRL computes them", checks.one_of(*METHODS))
    beta: float | None = _opt(None, "the preference methods' beta (default: the method's, "
                                    "TRL's 0.1)", _default_or_positive, kind=float)
    label_smoothing: float = _opt(0.0, "dpo: robust DPO's label noise; simpo: the "
                                       "conservative loss's", checks.Check(float, lo=0, hi=0.5,
                                                                          hi_open=True))
    simpo_gamma: float = _opt(0.5, "simpo's target reward margin", checks.nonnegative())
    # runs people steer (train/steering.py, train/samples.py)
    early_stop: int = _opt(0, "stop after N evaluations (--eval-every) without a lower "
                              "held-out loss; adapter/ (model/ with --fine-tune-type full, "
                              "which keeps a copy of the best weights in memory) then holds "
                              "the best evaluation's weights, and the run says its step "
                              "(0: off)", checks.count(0))
    samples: int = _opt(2, "at each evaluation, greedy answers to N held-out prompts "
                           "(with --sample-prompts: to each of the file's), printed under "
                           "the progress bar and kept in log.jsonl (0: off)",
                        checks.Check(int, lo=0, hi=64))
    sample_tokens: int = _opt(32, "new tokens per sample answer",
                              checks.Check(int, lo=1, hi=4096))
    sample_prompts: str = _opt("", "sample these prompts instead of held-out ones: a file "
                                   "of one prompt a line, or a .jsonl of strings, "
                                   "{\"prompt\": ...} or {\"messages\": [...]}; sent "
                                   "through the model's chat template where it has one",
                               path=True)
    resume: bool = _opt(False, "continue from the checkpoint in --out")
    progress: bool = _opt(True, "show a progress bar", cli=False)

    def __post_init__(self):
        """Every field against its declared type and range: a bad value stops here, before
        a model is loaded or a file is touched."""
        for f in dataclasses.fields(self):
            name, value, meta = flag(f.name), getattr(self, f.name), f.metadata
            if meta.get("path") and isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, f.name, value)  # frozen: normalise once, here
            if value is None and "kind" in meta:  # an optional number left to its default
                continue
            checks.check_type(name, value, meta.get("kind", f.type))
            if meta.get("required") and not value:
                raise GradtapeError(f"{name} is required")
            if meta.get("check") is not None:
                meta["check"](name, value)
        # the options against the method: --label-smoothing with ipo, ... (one line)
        meth = method_row(self.method)
        for name, default in (("label_smoothing", 0.0), ("simpo_gamma", 0.5)):
            if meth.data != "preference" and getattr(self, name) != default:
                raise GradtapeError(f"{flag(name)} applies to the preference methods, not "
                                    f"{meth.name}")
        check_options(meth, self.options())
        # the adapter's options mean nothing when every weight is trained, and the other
        # way round (one line, naming the flag)
        if self.fine_tune_type == "full":
            for name, default in (("rank", 8), ("alpha", 16.0), ("targets", "all"),
                                  ("weights", "auto"), ("rslora", False), ("adapter", "")):
                if getattr(self, name) != default:
                    raise GradtapeError(f"{flag(name)} applies to --fine-tune-type lora or "
                                        "dora, not full (which trains every weight)")
        elif self.save_gguf:
            raise GradtapeError("--save-gguf applies to --fine-tune-type full (a LoRA run: "
                                "gradtape merge --format gguf writes the merged model)")
        steering.check_options(self)

    @classmethod
    def from_yaml(cls, path, **overrides) -> "FinetuneConfig":
        """The options of a YAML file (keys as the flags spell them: ``seq-len`` or
        ``seq_len``), ``overrides`` winning; every value checked as its flag's."""
        return cls(**{**config_file.read_config(path, cls), **overrides})

    def peak_lr(self) -> float:
        """``lr``, or the default for the run's method and fine-tune type (``DEFAULT_LR``)."""
        if self.lr is not None:
            return float(self.lr)
        trained = "full" if self.fine_tune_type == "full" else "adapter"
        return DEFAULT_LR[(method_row(self.method).data, trained)]

    def options(self) -> Options:
        """The method's numbers (``train.methods.Options``)."""
        return Options(self.beta, self.label_smoothing, self.simpo_gamma)

    @property
    def micro_rows(self) -> int:
        """Token rows a micro-batch's forward runs: a preference method's pairs are two
        sequences each."""
        pairs = method_row(self.method).data == "preference"
        return (2 if pairs else 1) * self.batch_size * self.seq_len
