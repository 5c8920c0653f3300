"""Run llama.cpp's converters with their pre-tokenizer check pinned.

Usage: ``python convert_pinned.py CONVERTER_DIR JOBS.json`` where the JSON file lists jobs
``[script, pre_kind, *args]``, script ``convert_hf_to_gguf.py`` (a model folder) or
``convert_lora_to_gguf.py`` (a PEFT adapter); all run in this one process (importing
torch and transformers once costs more than a small conversion).

The converter recognises a byte-level BPE tokenizer's pre-tokenizer by hashing how it
tokenizes a fixed text, and refuses a tokenizer it does not know.  A tokenizer trained for
a test has the family's split regex but its own vocabulary, so its hash is unknown: this
wrapper imports the converter unchanged and replaces only that detection
(``TextModel.get_vocab_base_pre``) by the kind the family uses (``llama-bpe``,
``qwen2``, ...), which is what the converter writes for the real model.
"""

import json
import runpy
import sys
from pathlib import Path


def main():
    conv_dir, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    # the converter's own gguf-py, ahead of any installed gguf (as the scripts themselves do)
    sys.path[:0] = [str(conv_dir), str(conv_dir / "gguf-py")]
    from conversion import base

    for script, pre_kind, *args in jobs:
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer, kind=pre_kind: kind
        sys.argv = [str(conv_dir / script), *args]
        runpy.run_path(str(conv_dir / script), run_name="__main__")


if __name__ == "__main__":
    main()
