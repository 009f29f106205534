"""The OpenAI-compatible chat server, a module per responsibility: the wire format (`openai_api`), the prefix store
shared by every conversation (`store`) and the engine that serves one request from it (`engine`), the job queue and
its worker (`jobs`), the limits a request is held to (`limits`), authentication (`auth`), replies (`replies`), metrics
(`metrics`), the FastAPI app (`app`), uvicorn plumbing (`hosting`) and the ``peft-kvcache serve`` command
(`command`). The app needs the ``serve`` extra (``pip install "peft-kvcache[serve]"``); the command's options and
its check for that extra do not, so ``peft-kvcache --help`` works without it and ``serve`` says which extra to install
before any model loads.

Imports `runtime`, `maps`, `modeling` (fixture models for ``--model``: `modeling.fixtures`) and the foundation; the
command may import `calibration` and `lab.corpus` (``--calibrate-missing`` fits on the stdlib calibration split).
"""
