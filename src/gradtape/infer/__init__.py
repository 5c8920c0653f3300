"""gradtape.infer: running a loaded model: logits, and generation with a KV cache.

``runner.Runner`` is the entry: ``logits`` and ``generate`` for one model, keeping the
programs generation reuses.  Under it: the KV cache and the cached forward
(``kv_cache``), the one-token ``DecodeStep`` (``decode_step``), the compiled prompt
(``prompt_step``) and how a prompt runs (``prompt_choice``), the C decode engine's
wrapper (``block_decoder``), the checked inputs (``inputs``), sampling (``sampling``) and
the generate loop with its stop conditions (``loop``).  Imports ``models`` (the graph,
configs, LoRA) and the core and backends below it; never ``train``, ``cli`` or
``llama`` (the public facade, ``llama.Llama``, delegates here).  This package imports
nothing at import time, so ``infer.sampling`` stays cheap for the CLI's option checks.
"""
