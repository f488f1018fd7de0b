"""Importing Triton kernel modules in tests: compiled with CUDA, interpreted on CPU otherwise.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when its module is imported, so it is
set before that import; a module imported earlier without it is imported again.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def import_kernels(module_name: str, kernel_name: str) -> ModuleType:
    """The module, its kernels runnable here; `kernel_name` is one of its @triton.jit functions."""
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    module = importlib.import_module(module_name)
    if HAS_CUDA:
        return module
    if not triton.knobs.runtime.interpret:
        pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(module, kernel_name), InterpretedFunction):
        module = importlib.reload(module)
    return module
