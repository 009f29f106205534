"""Benchmarks of peft-kvcache: each writes its figures, with provenance, under benchmarks/results/ only.

Run them from the repository root as modules, e.g. ``python -m benchmarks.ttft --help``.
"""
