"""``python -m foxlm``: the ``foxlm`` command, e.g. ``torchrun --nproc-per-node 8 -m foxlm train ...``."""

import sys

from foxlm.cli import main

sys.exit(main())
