"""Cross-adapter prefix reuse inside vLLM: a KV connector (`connector.PeftKVCacheConnector`) that vLLM loads by
module path. It keeps the KV of finished requests in a bounded store and, when a request for one model variant (the
base model or a LoRA adapter) shares a token prefix with a stored request of another, maps that prefix with the
published map between them and writes it into vLLM's paged cache; vLLM computes the rest.

Owns: the options (`options`), the CPU backend's paged layout (`layout`), the store and its index (`store`), the
published maps that fit the engine's models (`pairs`), the scheduler's half (`scheduler`, with what it takes out of
vLLM's prefix cache, `evictions`, and which variants' files changed, `staleness`), the worker's half (`worker`, whose
jobs a CPU engine runs within its steps: `slices`) and the connector vLLM calls (`connector`). Imports `maps`,
`modeling` and the foundation, and vLLM itself (only these modules do); never the runtime, calibration, serving or
`lab`. Needs the ``vllm`` extra.
"""
