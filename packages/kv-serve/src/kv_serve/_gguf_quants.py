"""GGUF quantized blocks kept quantized: the ones that are MLX affine groups of 32 exactly.

MLX's affine quantization stores a group of values as ``scale * q + bias`` with ``q`` an
unsigned ``bits``-bit code, the codes of a row packed as one little-endian bit stream. Several
llama.cpp block types are exactly that with groups of 32:

- ``Q8_0``: ``d * q`` with ``q`` in -128..127: codes ``q + 128``, scale ``d``, bias ``-128 d``;
- ``Q4_0`` / ``Q5_0``: ``d * (q - 8)`` / ``d * (q - 16)``: scale ``d``, bias ``-8 d`` / ``-16 d``;
- ``Q4_1`` / ``Q5_1``: ``d * q + m``: scale ``d``, bias ``m``;
- ``Q4_K``: super-blocks of 256 with eight 6-bit scales and mins: each group of 32 is
  ``(d * sc) * q - dmin * m``: scale ``d * sc``, bias ``-dmin * m``.

Scales and biases are float32 (products of a float16 and a small integer: exact). ``Q6_K``
(groups of 16) and ``Q2_K`` / ``Q3_K`` / ``Q5_K`` have no such exact form here and are
dequantized as before.

:func:`kernel_codes` gives the same blocks in the form the native CPU kernel
(``kv_metal_kernels.CpuQuantizedHead``) reads: 4-bit codes stay 4-bit, 5-bit codes are
widened to 8 bits (the same values), and ``Q6_K`` becomes 8-bit codes in groups of 16
(``d * sc * (q - 32)``: scale ``d * sc``, bias ``-32 d sc``), a group size MLX's own
quantized ops do not take.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["GROUP_SIZE", "KEPT_TYPES", "KERNEL_TYPES", "affine_blocks", "kernel_codes"]

#: Every kept type's group size (llama.cpp's blocks and K sub-blocks hold 32 values).
GROUP_SIZE = 32

#: The GGML type names kept quantized, with their bits per code.
KEPT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4}

#: The GGML type names :func:`kernel_codes` serves: ``(bits of the kernel's codes, group size)``.
KERNEL_TYPES = {
    "Q8_0": (8, 32),
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "Q4_K": (4, 32),
    "Q6_K": (8, 16),
}

_F16 = np.dtype("<f2")

Affine = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], int]


def affine_blocks(
    type_name: str, raw: np.ndarray[Any, Any], shape: tuple[int, ...]
) -> Affine | None:
    """``(packed codes uint32, scales, biases, bits)`` of a tensor in MLX's layout, or None.

    ``raw`` is the tensor's bytes (any shape of uint8); ``shape`` its row-major (mlx) shape,
    the groups running along the last axis. ``None`` when the type has no exact form here.
    """
    bits = KEPT_TYPES.get(type_name)
    if bits is None or len(shape) != 2 or shape[-1] % GROUP_SIZE:
        return None
    codes, scales, biases = _laid_out(type_name, raw, shape, bits, GROUP_SIZE)
    return codes, scales, biases, bits


def kernel_codes(
    type_name: str, raw: np.ndarray[Any, Any], shape: tuple[int, ...]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], int, int] | None:
    """``(packed codes uint32, scales, biases, bits, group_size)`` for the native CPU kernel.

    The same values as the block type's dequantization (``scale * code + bias`` per group
    of ``group_size`` along the last axis; codes of 4 or 8 bits in MLX's packing), or
    ``None`` for a type, rank or width it does not serve. ``raw`` and ``shape`` as in
    :func:`affine_blocks`.
    """
    form = KERNEL_TYPES.get(type_name)
    if form is None or len(shape) != 2:
        return None
    bits, group = form
    block = 256 if type_name.endswith("_K") else GROUP_SIZE
    if shape[-1] % block:
        return None
    codes, scales, biases = _laid_out(type_name, raw, shape, bits, group)
    return codes, scales, biases, bits, group


def _laid_out(
    type_name: str, raw: np.ndarray[Any, Any], shape: tuple[int, ...], bits: int, group: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A 2-D tensor's blocks decoded: codes packed at ``bits``, float32 scales and biases."""
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if type_name == "Q6_K":
        codes, scales, biases = _q6_k(data)
    elif type_name == "Q4_K":
        codes, scales, biases = _q4_k(data)
    else:
        codes, scales, biases = _small_block(type_name, data)
    rows, cols = shape
    groups = cols // group
    return (
        _pack(codes.reshape(rows, cols), bits),
        scales.reshape(rows, groups).astype(np.float32),
        biases.reshape(rows, groups).astype(np.float32),
    )


def _f16(blocks: np.ndarray[Any, Any], at: int) -> np.ndarray[Any, Any]:
    """The float16 at byte ``at`` of every block, as float32 (column vector)."""
    return blocks[:, at : at + 2].copy().view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """32 codes of a 16-byte block: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint32)


def _small_block(
    type_name: str, data: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Codes (n_blocks, 32), scales and biases (n_blocks, 1) of the 32-value block types."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[type_name]
    blocks = data.reshape(-1, size)
    d = _f16(blocks, 0)
    if type_name == "Q8_0":
        signed = blocks[:, 2:34].view(np.int8).astype(np.int32)
        return (signed + 128).astype(np.uint32), d, -128.0 * d
    with_min = type_name.endswith("_1")
    start = 4 if with_min else 2
    if type_name.startswith("Q4"):
        codes = _nibbles(blocks[:, start : start + 16])
        offset = 8
    else:
        high = blocks[:, start : start + 4].copy().view("<u4").astype(np.uint32)
        low = _nibbles(blocks[:, start + 4 : start + 20])
        codes = low | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4)
        offset = 16
    if with_min:
        return codes, d, _f16(blocks, 2)
    return codes, d, -float(offset) * d


def _q4_k(
    data: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Codes (n, 256) and per-32 scales and biases (n, 8) of Q4_K super-blocks."""
    blocks = data.reshape(-1, 144)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[:, 4:16].astype(np.uint32)
    sc = np.empty((blocks.shape[0], 8), dtype=np.uint32)
    mn = np.empty_like(sc)
    # Eight 6-bit scales and mins in 12 bytes (llama.cpp's get_scale_min_k4).
    sc[:, :4] = packed[:, 0:4] & 63
    mn[:, :4] = packed[:, 4:8] & 63
    sc[:, 4:] = (packed[:, 8:12] & 0x0F) | ((packed[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    # Each 32 bytes hold two groups: the low nibbles, then the high nibbles.
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256).astype(np.uint32)
    return codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(
    data: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Codes (n, 256) and per-16 scales and biases (n, 16) of Q6_K super-blocks.

    A super-block is 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed
    8-bit scales and the float16 ``d``. Each half of 128 values takes 64 low-nibble bytes
    and 32 high-part bytes: value ``l + 32 j`` (``l`` < 32, ``j`` < 4) has the low (``j``
    even) or high (``j`` odd) nibble of byte ``l`` (``j`` < 2) or ``l + 32``, and bits
    ``2 j, 2 j + 1`` of high-part byte ``l``; value ``p`` of the super-block uses scale
    ``p // 16``.
    """
    blocks = data.reshape(-1, 210)
    n = blocks.shape[0]
    d = _f16(blocks, 208)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    codes = np.empty((n, 2, 4, 32), dtype=np.uint32)
    for half in range(2):
        ql = blocks[:, 64 * half : 64 * half + 64].astype(np.uint32)
        qh = blocks[:, 128 + 32 * half : 160 + 32 * half].astype(np.uint32)
        low = (ql[:, :32] & 0x0F, ql[:, 32:] & 0x0F, ql[:, :32] >> 4, ql[:, 32:] >> 4)
        for j in range(4):
            codes[:, half, j] = low[j] | (((qh >> (2 * j)) & 3) << 4)
    scales = d * sc
    return codes.reshape(n, 256), scales, -32.0 * scales


def _pack(codes: np.ndarray[Any, Any], bits: int) -> np.ndarray[Any, Any]:
    """MLX's packing: each row's codes as one little-endian bit stream of uint32 words."""
    rows, cols = codes.shape
    small: np.ndarray[Any, Any] = codes.astype(np.uint8)
    stream: np.ndarray[Any, Any]
    if bits == 8:
        stream = small
    elif bits == 4:
        stream = small[:, 0::2] | (small[:, 1::2] << 4)
    else:
        # Bit by bit, a block of rows at a time (the spread bits take ``bits`` bytes a code).
        stream = np.empty((rows, cols * bits // 8), dtype=np.uint8)
        shifts = np.arange(bits, dtype=np.uint8)
        for start in range(0, rows, 1024):
            block = small[start : start + 1024]
            spread = ((block[..., None] >> shifts) & 1).reshape(block.shape[0], cols * bits)
            stream[start : start + 1024] = np.packbits(spread, axis=1, bitorder="little")
    return np.ascontiguousarray(stream).view("<u4")
