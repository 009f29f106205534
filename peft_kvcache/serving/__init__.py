"""The OpenAI-compatible chat server: the wire format (`openai_api`), the prefix store shared by every
conversation and the engine that serves one request from it (`prefix_store`), the FastAPI app (`app`) and the
``peft-kvcache serve`` command (`command`). The app needs the ``serve`` extra (``pip install
"peft-kvcache[serve]"``); the command's options and its check for that extra do not, so ``peft-kvcache --help``
works without it and ``serve`` says which extra to install before any model loads.

Imports `runtime`, `maps`, `modeling`, `lab` (fixture models for ``--model``) and the foundation; the command may
import `calibration` (``--calibrate-missing``).
"""
