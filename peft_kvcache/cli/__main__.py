"""``python -m peft_kvcache.cli`` (e.g. under ``torchrun``): the command line."""

import sys

from . import main

sys.exit(main())
