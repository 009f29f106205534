#!/usr/bin/env bash
# One command for an environment with vLLM's CPU build and this package (the KV connector), ready to serve and test:
#
#     bash scripts/vllm_env.sh [VENV]        # default: .venv-vllm
#
# vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20, so it gets a virtual environment of its own. Its
# wheel also pulls torchvision, torchaudio and torchcodec, which PyPI has only as CUDA builds; they break `import
# vllm` (operator torchvision::nms does not exist) and vLLM runs without them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python -m venv "$venv"
"$venv/bin/python" -m pip install -q -c constraints-vllm.txt -e ".[vllm]" pytest
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, peft_kvcache.vllm.connector; print('vllm', vllm.__version__, 'ready in $venv')"
