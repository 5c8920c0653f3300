"""Run llama.cpp's ``convert_hf_to_gguf.py`` with its pre-tokenizer check pinned.

Usage: ``python convert_pinned.py CONVERTER_DIR PRE_KIND SCRIPT [script args...]`` with
SCRIPT ``convert_hf_to_gguf.py`` (a model) or ``convert_lora_to_gguf.py`` (a PEFT adapter).

The converter recognises a byte-level BPE tokenizer's pre-tokenizer by hashing how it
tokenizes a fixed text, and refuses a tokenizer it does not know.  A tokenizer trained for
a test has the family's split regex but its own vocabulary, so its hash is unknown: this
wrapper imports the converter unchanged and replaces only that detection
(``TextModel.get_vocab_base_pre``) by the kind the family uses (``llama-bpe``,
``qwen2``, ...), which is what the converter writes for the real model.
"""

import runpy
import sys
from pathlib import Path


def main():
    conv_dir, pre_kind, script, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    # the converter's own gguf-py, ahead of any installed gguf (as the script itself does)
    sys.path[:0] = [str(conv_dir), str(conv_dir / "gguf-py")]
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_kind
    sys.argv = [str(conv_dir / script), *rest]
    runpy.run_path(str(conv_dir / script), run_name="__main__")


if __name__ == "__main__":
    main()
