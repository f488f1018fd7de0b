"""Launching Triton kernels with less host work than `kernel[grid](...)`.

On every call Triton's JIT binds and specialises each argument, builds a cache-key string and
checks the kernel's globals before its compiled launcher runs, several times the launcher's own
host time (docs/benchmarks.md, "Engine internals"); an eager step launches hundreds of kernels.
`launch` keeps each kernel's compiled binaries under a key of the device and of what Triton
specialises them on (each tensor's dtype and 16-byte alignment; each tensor descriptor's dtype
and block shape; each integer's equality to 1, divisibility by 16 and 32-bit range; the keyword
arguments: constexprs and launch options) and calls the binary's launcher directly. A call with
a new key goes through Triton, which compiles or finds the binary.

Under the interpreter, with Triton's launch hooks set (its profiler), or if the launcher does not
take the arguments this Triton version was seen to take, every call goes through Triton.

Calls with a new key (compiling a variant, or loading it from Triton's cache) are listed in
`first_launches` with their host time: a step that pays it in the middle of serving stalls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstLaunch:
    """A call that went through Triton for a new key: `kernel` with these constexprs and launch
    options, and these specialisations of its other arguments (`_arg_key` of each), took
    `seconds` of host time to compile or load."""

    kernel: str
    options: tuple[tuple[str, Any], ...]
    arguments: tuple
    seconds: float

    def __str__(self) -> str:
        options = ", ".join(f"{name}={value}" for name, value in self.options)
        return f"{self.kernel}({options}; arguments {self.arguments})"


_binaries: dict[tuple, tuple[Any, tuple]] = {}
_direct = True  # cleared if the compiled launcher rejects the call
_first_launches: list[FirstLaunch] = []


def first_launches(since: int = 0) -> list[FirstLaunch]:
    """The calls that went through Triton for a new key in this process, oldest first, from
    the `since`-th on."""
    return _first_launches[since:]


def first_launch_count() -> int:
    """How many calls went through Triton for a new key in this process so far."""
    return len(_first_launches)


def _arg_key(arg: object) -> object:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if isinstance(arg, TensorDescriptor):  # Triton compiles for its dtype and block shape only
        return arg.base.dtype, tuple(arg.block_shape)
    if type(arg) is int:
        return arg == 1, arg & 15 == 0, -(2**31) <= arg < 2**31
    return arg if arg is None or type(arg) is bool else type(arg)


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)  # a HookChain, or None


def launch(kernel: JITFunction, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """`kernel[grid](*args, **kwargs)`, where kwargs are the kernel's constexprs (every parameter
    after the positional ones) and launch options (num_warps, num_stages)."""
    global _direct
    if not _direct or not isinstance(kernel, JITFunction) or _hooks_set():
        kernel[grid](*args, **kwargs)
        return
    driver = triton.runtime.driver.active
    device = driver.get_current_device()  # a binary is loaded in one device's context
    key = (kernel, device, tuple(map(_arg_key, args)), tuple(kwargs.items()))
    cached = _binaries.get(key)
    if cached is None:
        start = time.perf_counter()
        binary = kernel[grid](*args, **kwargs)
        seconds = time.perf_counter() - start
        if binary is not None:  # None: a cache hook of Triton's took over the launch
            # The launcher takes every parameter in signature order, constexprs included.
            constexprs = tuple(kwargs[name] for name in kernel.arg_names[len(args) :])
            _binaries[key] = (binary, constexprs)
            _first_launches.append(FirstLaunch(kernel.__name__, key[3], key[2], seconds))
            logger.debug("first launch of %s: %.3f s", _first_launches[-1], seconds)
        return
    binary, constexprs = cached
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    stream = driver.get_current_stream(device)
    try:
        binary.run(
            grid_x, grid_y, grid_z, stream, binary.function, binary.packed_metadata,
            None, None, None, *args, *constexprs,
        )  # fmt: skip
    except TypeError:  # another Triton's launcher signature: rejected before launching
        _direct = False
        kernel[grid](*args, **kwargs)
