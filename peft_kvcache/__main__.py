"""``python -m peft_kvcache``: the same command line as ``peft-kvcache``."""

import sys

from .cli import main

sys.exit(main())
