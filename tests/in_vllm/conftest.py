"""Real vLLM engines (its CPU build, in its own environment: scripts/vllm_env.sh) with the connector, on SmolLM2-135M
and the committed adapters. Engines run in float32: in bfloat16 even vLLM's own prefix-cache hits change replies."""

from __future__ import annotations

import os

for name, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{min(os.cpu_count() or 1, 2) - 1}"}.items():
    os.environ.setdefault(name, value)  # before vLLM is imported

import shutil  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from peft_kvcache.modeling.fixtures import converted_path, fixture_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM = "gguf:smollm2-135m-instruct"
ADAPTERS = {"shout": ROOT / "adapters" / "shout", "docstring": ROOT / "adapters" / "docstring"}
# A system prompt long enough that conversations share whole 128-token blocks (held-out text is not needed: these
# tests compare the connector with vLLM's own prefill and with the library, not retention).
SYSTEM = ("You are a careful Python documentation assistant. You read one Python function at a time and write the "
          "docstring that belongs to it: what it computes, every parameter with its type, the return value and the "
          "exceptions it raises on purpose. Keep the first line short, in the imperative mood. ") * 6
BASE_NAME = "smollm2"  # the base model's served name: labels name it (mapped:smollm2)
FUNCTIONS = ["def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
             "def chunks(seq, n):\n    for i in range(0, len(seq), n):\n        yield seq[i:i + n]\n",
             "def mean(xs):\n    return sum(xs) / len(xs)\n"]

needs_smollm = pytest.mark.skipif(not fixture_available(SMOLLM), reason="run `python -m peft_kvcache.modeling.fixtures`")


@pytest.fixture(scope="session")
def model_folder() -> Path:
    if not fixture_available(SMOLLM):
        pytest.skip("run `python -m peft_kvcache.modeling.fixtures` first")
    return converted_path(SMOLLM)


@pytest.fixture(scope="session")
def tokenizer(model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


@pytest.fixture
def prompt(tokenizer, request):
    """Token ids of a chat: a long system prompt that starts with the test's own name (so tests share no prefix but
    the first token), then a request about function ``i`` (or any text)."""
    def build(i: int | str, system: str | None = None) -> list[int]:
        text = FUNCTIONS[i] if isinstance(i, int) else i
        system = f"Conversation {request.node.name}. {SYSTEM}" if system is None else system
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": f"Write the docstring of this function:\n{text}"}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    return build


@pytest.fixture(scope="session")
def maps_folder(tmp_path_factory) -> Path:
    """A copy of the published maps (a test may damage it)."""
    folder = tmp_path_factory.mktemp("maps")
    for name in ("smollm2-135m-instruct-base-to-shout", "smollm2-135m-instruct-base-to-docstring",
                 "smollm2-135m-instruct-docstring-to-base"):
        shutil.copytree(ROOT / "hub_cards" / name, folder / name)
    return folder


@contextmanager
def engine(model_folder: Path, *, dtype: str = "float32", llm_args: dict | None = None, adapters: dict | None = None,
           served_name: str = BASE_NAME, transfer_args: dict | None = None, **options):
    """A vLLM engine serving a model (SmolLM2) and its adapters (``adapters``, default the committed `ADAPTERS`)
    through the connector with ``options`` (``llm_args``: more of vLLM's own engine arguments; ``transfer_args``: of
    its ``KVTransferConfig``)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(**{"kv_connector": "PeftKVCacheConnector", "kv_role": "kv_both",
                                   "kv_connector_module_path": "peft_kvcache.vllm.connector",
                                   "kv_connector_extra_config": {key: str(v) if isinstance(v, Path) else v
                                                                 for key, v in options.items()},
                                   **(transfer_args or {})})
    arguments = dict(model=str(model_folder), served_model_name=served_name, dtype=dtype, enforce_eager=True,
                     enable_lora=True, max_lora_rank=8, max_loras=4, max_model_len=2048, max_num_seqs=4, seed=0,
                     kv_transfer_config=transfer, disable_log_stats=False)
    llm = LLM(**{**arguments, **(llm_args or {})})
    llm.peft_kvcache_adapters = dict(ADAPTERS if adapters is None else adapters)  # what run() names by LoRA id
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def run(llm, ids: list[int], adapter: str | None = None, *, salt: str | None = None, reuse: str | None = None,
        max_tokens: int = 8, logprobs: int = 20, params: dict | None = None, lora_id: int | None = None,
        ignore_eos: bool = False):
    """One greedy request (``adapter``: a name of the engine's adapters, which a test may extend; ``lora_id``: its
    LoRA id, default its place among them; ``params``: its ``kv_transfer_params.peft_kvcache``, default from
    ``reuse``; ``ignore_eos``: generate all ``max_tokens``); returns vLLM's output (text, first-token logprobs,
    kv_transfer_params)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = llm.peft_kvcache_adapters
    ours = params if params is not None else {"reuse": reuse} if reuse else None
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=ignore_eos,
                              extra_args={"kv_transfer_params": {"peft_kvcache": ours}} if ours is not None else None)
    lora = None if adapter is None else LoRARequest(adapter, lora_id or list(adapters).index(adapter) + 1,
                                                    str(adapters[adapter]))
    request = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
    return llm.generate([request], sampling, lora_request=lora, use_tqdm=False)[0]


def reset(llm, connector: bool = False, timeout: float = 30.0) -> None:
    """vLLM's prefix cache reset (and the connector's store with ``connector``), once the blocks of finished requests
    are free (the connector holds them until its copy of them is done, a step or two)."""
    import time

    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache(reset_connector=connector):
        assert time.monotonic() < deadline, "the prefix cache could not be reset"
        time.sleep(0.05)


def source_of(output) -> str:
    return (output.kv_transfer_params or {}).get("peft_kvcache", {}).get("context_source")
