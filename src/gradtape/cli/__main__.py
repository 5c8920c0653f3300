"""``python -m gradtape.cli COMMAND ...``: the same as the ``gradtape`` script."""

import sys

from .main import main

sys.exit(main())
