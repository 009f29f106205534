"""What the library needs to know about a transformers (or PEFT) causal LM, and how it runs one.

Owns: the KV layout and decoder layers of a model (`layout`), its identity and weight fingerprints (`identity`),
its PEFT adapters and the one lock over their state (`adapters`), rotary positions in and out of cached keys
(`positions`), one forward pass that returns a model's KV (`capture`), and every reliance on transformers'
internals (`_compat`). Imports only the package's foundation (`errors`, `_files`); everything else builds on it.
"""
