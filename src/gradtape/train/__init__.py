"""gradtape.train: fine-tuning a model from ``gradtape.models``.

``records`` (data files and their schemas, read and checked), ``data`` (records into
token rows with loss masks, batch order), ``step``
(one training step recorded once and compiled: forward, loss, backward, clipping, AdamW),
``finetune`` (the loop: checkpoints, resume, logging, loss plot) and ``distributed`` (MPI
data parallelism).  May import the core, ``formats`` and ``models``; never ``cli``.
"""
