"""The examples in the public docstrings run as written (those marked ``+SKIP`` need real models or a server): an
example that no longer holds fails here, not in a reader's hands. The vLLM package's modules import vLLM and run in
its own environment's tests."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import peft_kvcache

MODULES = sorted(m.name for m in pkgutil.walk_packages(peft_kvcache.__path__, "peft_kvcache.")
                 if not m.name.startswith("peft_kvcache.vllm") and not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} fail (python -m doctest -v)"
