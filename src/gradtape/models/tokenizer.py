"""The tokenizer of a LLaMA-family model, and its chat template.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from GGUF metadata
(``from_gguf``) or from a Hugging Face ``tokenizer.json`` (``from_hf_folder``).  GGUF
holds two kinds of vocabulary.  Byte-level BPE ("gpt2": vocabulary, merges, the
pre-tokenizer regex named by ``tokenizer.ggml.pre``) is built as transformers' GGUF
converter builds it, so encoding matches that reference id for id.  Sentencepiece
("llama": pieces, scores, token types, byte pieces, ``add_space_prefix``) is built as a
BPE whose merges are ranked by piece score, which encodes as the model's own
sentencepiece tokenizer does (``_sentencepiece_bpe``).  In both, control tokens are added
whole as special tokens and user-defined tokens as plain added tokens.

The chat template (jinja2, as stored in the model) renders a list of messages with the
same environment settings transformers uses (trim_blocks, lstrip_blocks, sandboxed).
This module does not run the model.
"""

from __future__ import annotations

import json
from functools import lru_cache

from ..errors import FileFormatError

# Token types in GGUF's tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes by GGUF ``tokenizer.ggml.pre``, the ones transformers' GGUF
# converter overrides (everything else, "smollm" and "gpt2" included, keeps GPT-2's
# ByteLevel regex there, so it does here too).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx",
                                  "smaug-bpe", "pixtral")},
    **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen")},
}

# Ids that end a generation besides the model's eos, when the vocabulary has them as
# special tokens (an instruct model's eos is its turn end; it may still emit these).
_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
               "<end_of_turn>", "<|end|>")


@lru_cache(maxsize=1)
def _bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map (as in transformers)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text``, ``apply_chat_template``."""

    def __init__(self, backend, eos_id=None, bos_id=None, chat_template=None,
                 special_tokens=None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # name -> token text
        ends = {eos_id} if eos_id is not None else set()
        for t in _END_TOKENS:
            tid = backend.token_to_id(t)
            if tid is not None and t in self._specials():
                ends.add(tid)
        self.stop_ids = frozenset(ends)

    def _specials(self):
        return {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``)
        become their single ids; a BOS is added only where the model asks for one."""
        if not isinstance(text, str):
            raise TypeError(f"encode: needs a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids],
                                   skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self.backend.token_to_id(token)

    def hf_files(self, model_max_length=None) -> dict:
        """``{file name: text}`` of a Hugging Face tokenizer (``tokenizer.json`` and
        ``tokenizer_config.json`` with the chat template and special tokens) that
        ``from_hf_folder`` and transformers' ``AutoTokenizer`` read back."""
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **self.special_tokens}
        if self.chat_template:
            tc["chat_template"] = self.chat_template
        if model_max_length:
            tc["model_max_length"] = int(model_max_length)
        return {"tokenizer.json": self.backend.to_str(pretty=True),
                "tokenizer_config.json": json.dumps(tc, indent=2, ensure_ascii=False) + "\n"}

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            **extra) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's
        jinja2 chat template, as transformers' ``apply_chat_template(tokenize=False)``."""
        if not self.chat_template:
            raise FileFormatError("this model has no chat template")
        return _render(self.chat_template, messages=list(messages),
                       add_generation_prompt=add_generation_prompt,
                       **self.special_tokens, **extra)

    # --- builders -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: dict, where: str) -> "Tokenizer":
        """From GGUF metadata (key -> python value): a byte-level BPE vocabulary ("gpt2")
        or a sentencepiece one ("llama")."""
        from tokenizers import AddedToken, processors

        kind = meta.get("tokenizer.ggml.model")
        build = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}.get(kind)
        if build is None:
            raise FileFormatError(f"{where}: tokenizer model {kind!r} is not supported "
                                  "(only byte-level BPE, 'gpt2', and sentencepiece, 'llama')")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise FileFormatError(f"{where}: tokenizer.ggml.tokens missing")
        types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise FileFormatError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
        tk, whole = build(meta, where, tokens, types)
        # control tokens (<|im_start|>, <start_of_turn>) stay whole as special tokens and
        # user-defined ones whole as plain added tokens, both matched in the raw text
        # (llama.cpp splits the text on them before tokenizing the pieces between)
        control = [AddedToken(whole(t), normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and whole(t)]
        if control:
            tk.add_special_tokens(control)
        user = [AddedToken(whole(t), normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and whole(t)]
        if user:
            tk.add_tokens(user)

        def tid(key):
            v = meta.get(key)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        bos, eos = tid("tokenizer.ggml.bos_token_id"), tid("tokenizer.ggml.eos_token_id")
        # llama.cpp adds a BOS to sentencepiece vocabularies unless the file says not to
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) \
            and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None
        if add_bos or add_eos:
            b = f"{tokens[bos]} " if add_bos else ""
            e = f" {tokens[eos]}" if add_eos else ""
            tk.post_processor = processors.TemplateProcessing(
                single=f"{b}$A{e}", pair=f"{b}$A{e} {b}$B{e}",
                special_tokens=[(tokens[i], i) for i in dict.fromkeys(
                    ([bos] if add_bos else []) + ([eos] if add_eos else []))])
        names = {"bos_token": bos, "eos_token": eos,
                 "unk_token": tid("tokenizer.ggml.unknown_token_id"),
                 "pad_token": tid("tokenizer.ggml.padding_token_id")}
        special = {k: tokens[v] for k, v in names.items() if v is not None}
        return cls(tk, eos_id=eos, bos_id=bos,
                   chat_template=meta.get("tokenizer.chat_template"), special_tokens=special)

    @classmethod
    def from_hf_folder(cls, folder, eos_id=None, bos_id=None) -> "Tokenizer | None":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja``);
        ``None`` when the folder has no tokenizer.json."""
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise FileFormatError(f"{path}: not a valid tokenizer.json ({e})") from None
        tc = {}
        tc_path = folder / "tokenizer_config.json"
        if tc_path.is_file():
            try:
                tc = json.loads(tc_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise FileFormatError(f"{tc_path}: not valid JSON ({e})") from None
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = tc.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                special[name] = v
        if "eos_token" in special and tk.token_to_id(special["eos_token"]) is not None:
            eos_id = tk.token_to_id(special["eos_token"])
        if "bos_token" in special and tk.token_to_id(special["bos_token"]) is not None:
            bos_id = tk.token_to_id(special["bos_token"])
        return cls(tk, eos_id=eos_id, bos_id=bos_id, chat_template=template,
                   special_tokens=special)


def _byte_level_bpe(meta, where, tokens, types):
    """``(tokenizers.Tokenizer, whole)`` of a "gpt2" GGUF vocabulary: GPT-2's byte-level
    BPE with the file's merges and the split regex of its ``tokenizer.ggml.pre``.
    ``whole(token)``: the text an added token is matched by, or "" to leave it out."""
    from tokenizers import Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise FileFormatError(f"{where}: tokenizer.ggml.merges missing")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(tok):
        # tokens outside the byte alphabet (rare) are respelled byte by byte
        return tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode())

    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(spelled(tok), i)
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise FileFormatError(f"{where}: malformed merge {m!r}")
        pairs.append(tuple(parts))
    bpe = BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
              end_of_word_suffix="", fuse_unk=False)
    tk = HFTokenizer(bpe)
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()

    def whole(tok):
        # a "control" token outside the byte alphabet is a llama.cpp mislabel: skipped;
        # a user-defined one must be in the vocabulary as spelled
        return tok if set(tok) <= alphabet and tok in vocab else ""
    return tk, whole


def _sentencepiece_bpe(meta, where, tokens, types):
    """``(tokenizers.Tokenizer, whole)`` of a "llama" GGUF vocabulary: sentencepiece BPE
    with pieces spelled with U+2581 for spaces, one score per piece, byte pieces
    ``<0x0A>``.

    Sentencepiece BPE encodes a text by escaping its spaces as U+2581 (after a dummy
    prefix space where ``add_space_prefix``, default true, says so), splitting it into
    characters (a character not in the vocabulary into its UTF-8 byte pieces) and then
    repeatedly merging the adjacent pair whose concatenation is a normal piece of the
    highest score.  A BPE model whose merge ranks are the pieces ordered by score does
    the same; the merges are every split of a normal piece into two normal pieces,
    ranked by the piece's score (highest first), then its id.  The dummy prefix is a
    normalizer, so it goes before every stretch of text between control tokens, as
    llama.cpp and the slow sentencepiece tokenizers do; after a user-defined token too
    (llama.cpp's rule; sentencepiece itself would not prefix there, which matters only for
    a vocabulary with both a dummy prefix and user-defined tokens: Gemma has no prefix).  GGUF keeps no normalizer rules:
    a file asking for extra-whitespace removal or a precompiled character map (T5-style
    vocabularies) is refused rather than tokenized differently."""
    from tokenizers import decoders, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    for key in ("tokenizer.ggml.remove_extra_whitespaces", "tokenizer.ggml.precompiled_charsmap"):
        if meta.get(key):
            raise FileFormatError(f"{where}: {key} is set: sentencepiece normalization rules "
                                  "are not supported")
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
        raise FileFormatError(f"{where}: tokenizer.ggml.scores must list one number per token")
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    normal = {}  # piece -> (-score, id): its merge priority
    for i, (tok, ty, sc) in enumerate(zip(tokens, types, scores)):
        if ty == _NORMAL and vocab[tok] == i:
            normal[tok] = (-float(sc), i)
    ranked = []
    for tok, prio in normal.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                ranked.append((prio, left, right))
    ranked.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    has_bytes = _BYTE in types
    tk = HFTokenizer(BPE(vocab=vocab, merges=[(a, b) for _, a, b in ranked], dropout=None,
                         unk_token=unk, fuse_unk=True, byte_fallback=has_bytes))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    norm = [normalizers.Prepend("\u2581")] if prefix else []
    tk.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if has_bytes else [])
    dec.append(decoders.Fuse())
    if prefix:  # the dummy prefix comes off the start of the text again
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)

    def whole(tok):
        # llama.cpp's converter stores user-defined pieces with real spaces; a piece still
        # spelled with U+2581 means the same text
        return tok.replace("\u2581", " ")
    return tk, whole



def _render(template, **context):
    """Render a chat template the way transformers does (sandboxed jinja2, trim_blocks,
    lstrip_blocks, ``raise_exception``, a ``tojson`` that keeps non-ASCII)."""
    import jinja2

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env = _env()
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template).render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise FileFormatError(f"chat template: {e}") from None


def _env():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[loopcontrols])
