"""Chat with ``peft-kvcache serve`` through the official `openai` client, switching adapters turn by turn.

Start the server first (SmolLM2-135M-Instruct and the committed adapters; maps from hub_cards/, or fitted at
startup when they are missing):

    peft-kvcache serve --model gguf:smollm2-135m-instruct --served-model-name smollm2 \\
        --adapter shout=adapters/shout --adapter docstring=adapters/docstring --maps hub_cards --calibrate-missing

then, in another shell:

    python examples/chat_client.py                  # or --base-url http://127.0.0.1:8000/v1 --stream

Each turn prints the reply and how the server obtained the conversation's context: ``prefilled``, ``reused``
(a cache of the same model) or ``mapped:<base>`` (the base model's cache mapped into the adapter: the history
was not prefilled again), with the prompt tokens it did not prefill and the server's time to first token.
"""

from __future__ import annotations

import argparse

from openai import OpenAI

SCRIPT = [  # (model, user message): the base model, then a switch at every turn
    ("smollm2", "Here is a Python function:\n```python\ndef mean(values):\n    return sum(values) / len(values)\n```\n"
                "What does it do, in one sentence?"),
    ("docstring", "Write the docstring of this Python function:\n```python\ndef mean(values):\n"
                  "    return sum(values) / len(values)\n```"),
    ("shout", "What happens if the list is empty?"),
    ("smollm2", "Thanks. Summarize our conversation in one sentence."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="stream the replies (server-sent events)")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")  # the server checks no key
    models = client.models.list().data
    print("models:", ", ".join(m.id + (f" (adapter of {m.parent})" if m.parent else "") for m in models))
    base = next(m.id for m in models if not m.parent)
    messages = []
    for model, text in SCRIPT:
        model = base if model == "smollm2" else model
        messages.append({"role": "user", "content": text})
        request = dict(model=model, messages=messages, max_tokens=args.max_tokens, temperature=0)
        if args.stream:
            reply, info = "", {}
            for chunk in client.chat.completions.create(**request, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    reply += chunk.choices[0].delta.content
                    print(chunk.choices[0].delta.content, end="", flush=True)
                info = chunk.model_extra.get("peft_kvcache", info)  # the last chunk carries it
            print()
        else:
            completion = client.chat.completions.create(**request)
            reply, info = completion.choices[0].message.content, completion.model_extra["peft_kvcache"]
            print(reply)
        print(f"  [{model}] context {info['context_source']}, {info['cached_tokens']} prompt tokens not prefilled, "
              f"TTFT {info['ttft_seconds'] * 1000:.0f} ms\n")
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    main()
