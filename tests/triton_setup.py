"""Importing Triton kernel modules in tests: compiled with CUDA, interpreted on CPU otherwise.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when its module is imported, so
tests/conftest.py sets it (`use_interpreter_without_cuda`) before anything imports our modules.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def use_interpreter_without_cuda() -> None:
    """Without CUDA, Triton kernels run in Triton's interpreter (unless TRITON_INTERPRET says
    otherwise)."""
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def import_kernels(module_name: str) -> ModuleType:
    """The kernel module, its kernels runnable here (the tests skip where they cannot run)."""
    triton = pytest.importorskip("triton")
    if not HAS_CUDA and not triton.knobs.runtime.interpret:
        pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)
    return importlib.import_module(module_name)
