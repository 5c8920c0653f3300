"""gradtape.cli: the ``gradtape`` command, one module per subcommand.

``main`` holds the table of commands; each command module (``finetune``, ``generate``,
``merge``, ``export_gguf_lora``, ``bench``, ``demo``) offers ``add_arguments(parser)`` and
``run(args)`` and turns arguments into calls of ``models`` and ``train``.  Nothing imports
``cli``.
"""

from .main import main

__all__ = ["main"]
