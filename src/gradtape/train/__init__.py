"""gradtape.train: fine-tuning a model from ``gradtape.models``.

``data`` (text and JSONL into padded sequences with loss masks, batch order), ``step``
(one training step recorded once and compiled: forward, loss, backward, clipping, AdamW),
``finetune`` (the loop: checkpoints, resume, logging, loss plot) and ``distributed`` (MPI
data parallelism).  May import the core, ``formats`` and ``models``; never ``cli``.
"""
