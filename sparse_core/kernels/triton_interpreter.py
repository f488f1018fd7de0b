"""Work-arounds for Triton's CPU interpreter (TRITON_INTERPRET=1), where the kernel tests run.

Four interpreter bugs break our kernels on CPU; compiled GPU kernels are not affected:
- With numpy >= 2.4, a loop bound computed from `program_id` or a loaded value fails, because the
  interpreter calls `int()` on a one-element array (triton-lang/triton#9171, fixed after 3.6).
- `tl.dot` on bfloat16 multiplies the raw bit patterns: the interpreter stores bf16 as uint16 and
  hands those to `np.matmul` (still so in 3.8). Operands are widened to float32 first, exactly.
- float32 -> bfloat16 casts truncate, where the GPU (and torch) round to nearest even, so a cache
  written by `store_kv` would differ from torch's in the last bit.
- float32 -> float8e4nv (e4m3) casts lose the carry where rounding reaches the next power of two
  (127.3 becomes 64, not 128; still so in 3.6): torch's cast, which rounds as the GPU does, is
  used instead.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_applied = False


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the upper half of a float32: shift the stored uint16 into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the bit pattern, like torch (NaN inputs are not expected)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).reshape(np.shape(x))


def _float32_to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even into e4m3 (the kernels saturate before casting), as uint8 bits."""
    values = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(np.shape(x))


def apply_interpreter_fixes() -> None:
    """Patch the interpreter in this process; idempotent."""
    global _applied
    if _applied:
        return
    _applied = True

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_with_index(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor_with_index

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def create_dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_bits_to_float32(a.data), tl.float32)
        if b.dtype == tl.bfloat16:
            b = interpreter.TensorHandle(_bf16_bits_to_float32(b.data), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_widening_bf16

    cast_impl = builder.cast_impl

    def cast_rounding_to_bf16(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bf16_bits(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = cast_rounding_to_bf16
    fp_to_fp = builder.create_fp_to_fp

    def fp_to_fp_rounding_to_e4m3(self, src, dst_type, rounding_mode):  # fp8 casts come here
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return interpreter.TensorHandle(_float32_to_e4m3_bits(src.data), tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = fp_to_fp_rounding_to_e4m3
