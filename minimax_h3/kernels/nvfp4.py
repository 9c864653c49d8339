"""NVFP4 (E2M1 + F8-E4M3 block scales) weight dequantisation, ComfyUI / comfy-kitchen layout.

Format (docs/model.md §8.4, comfy-kitchen ``TensorCoreNVFP4Layout``):

- ``weight``          U8  [rows_p, cols_p/2]  two E2M1 codes per byte, rows/cols padded to 16.
                          comfy-kitchen packs element 2j into the HIGH nibble (``hi_first=True``).
- ``weight_scale``    F8-E4M3, one per 16 input elements, stored in cuBLAS' tiled ("swizzled")
                          layout padded to [ceil(rows/128)*128, ceil(cols/16/4)*4] (or flattened).
- ``weight_scale_2``  F32 scalar: the global (per-tensor) scale.
- optional ``pre_quant_scale`` [cols] (AWQ smoothing, multiplied into the activation before the
  GEMM; for a plain dequantise-at-load path it folds into the weight columns), ``input_scale``
  (activation fp4 scale; only meaningful for W4A4 GEMMs, unused when dequantising).

``W[r, c] = e2m1(code[r, c]) * block_scale[r, c // 16] * weight_scale_2 (* pre_quant_scale[c])``.
Arithmetic here is fp32 (comfy-kitchen's eager path multiplies the scales in the output dtype; for
a bf16 output that differs by at most bf16 rounding).
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16  # NVFP4 elements per F8 block scale
SWIZZLE_ROWS = 128  # cuBLAS block-scale tile: 128 rows x 4 scale columns
SWIZZLE_COLS = 4
# E2M1 code -> value (sign bit 3, 2 exponent bits, 1 mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pair_lut(hi_first: bool, device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: byte -> its two E2M1 values in element order (one gather per byte, no int64 codes)."""
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    hi, lo = v[b >> 4], v[b & 0x0F]
    return (torch.stack((hi, lo), -1) if hi_first else torch.stack((lo, hi), -1)).to(device)


def unpack_e2m1(packed: torch.Tensor, hi_first: bool = True) -> torch.Tensor:
    """U8 [..., n] -> fp32 [..., 2n] E2M1 values."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    pairs = torch.nn.functional.embedding(packed.int(), _pair_lut(hi_first, packed.device))
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, blocks_per_row: int) -> torch.Tensor:
    """Undo cuBLAS' tiled block-scale layout: -> [rows, blocks_per_row] (same dtype).

    Layout: the [R_p, C_p] scale matrix (R_p = ceil(rows/128)*128, C_p = ceil(blocks/4)*4) is cut
    into 128x4 tiles in row-major tile order; inside a tile, element (r, c) with r = 32*i + j sits
    at offset j*16 + i*4 + c. Same as comfy-kitchen's ``from_blocked`` (checked in tests).
    """
    rb, cb = _ceil_div(rows, SWIZZLE_ROWS), _ceil_div(blocks_per_row, SWIZZLE_COLS)
    if swizzled.numel() != rb * cb * SWIZZLE_ROWS * SWIZZLE_COLS:
        raise ValueError(
            f"NVFP4 block scale has {swizzled.numel()} elements; a swizzled [{rows}, {blocks_per_row}] "
            f"scale needs {rb * SWIZZLE_ROWS} x {cb * SWIZZLE_COLS} = {rb * cb * 512}"
        )
    # Byte-level view keeps fp8 out of ops that may lack fp8 kernels on some devices.
    raw = swizzled.contiguous().view(torch.uint8) if swizzled.dtype.itemsize == 1 else swizzled
    t = raw.reshape(rb, cb, 32, 4, 4)  # [tile_r, tile_c, j, i, c]
    t = t.permute(0, 3, 2, 1, 4)  # [tile_r, i, j, tile_c, c]  -> row = tile_r*128 + i*32 + j
    out = t.reshape(rb * SWIZZLE_ROWS, cb * SWIZZLE_COLS)[:rows, :blocks_per_row]
    return out.contiguous().view(swizzled.dtype) if raw is not swizzled else out.contiguous()


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unswizzle_block_scales` (test/fixture helper); returns the padded 2-D form."""
    rows, blocks = scales.shape
    rb, cb = _ceil_div(rows, SWIZZLE_ROWS), _ceil_div(blocks, SWIZZLE_COLS)
    raw = scales.contiguous().view(torch.uint8) if scales.dtype.itemsize == 1 else scales
    padded = torch.zeros(rb * SWIZZLE_ROWS, cb * SWIZZLE_COLS, dtype=raw.dtype, device=raw.device)
    padded[:rows, :blocks] = raw
    t = padded.reshape(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)
    out = t.reshape(rb * SWIZZLE_ROWS, cb * SWIZZLE_COLS).contiguous()
    return out.view(scales.dtype) if raw is not scales else out


def block_scales_are_swizzled(scale_shape: tuple[int, ...], rows: int, blocks_per_row: int) -> bool:
    """Decide from shapes whether a scale tensor is in the padded swizzled layout.

    When rows % 128 == 0 and blocks % 4 == 0 both layouts have the same shape; ComfyUI files always
    store the swizzled layout, so that case counts as swizzled.
    """
    padded = (_ceil_div(rows, SWIZZLE_ROWS) * SWIZZLE_ROWS, _ceil_div(blocks_per_row, SWIZZLE_COLS) * SWIZZLE_COLS)
    shape = tuple(scale_shape)
    if shape == padded or (len(shape) == 1 and shape[0] == padded[0] * padded[1]):
        return True
    if shape == (rows, blocks_per_row):
        return False
    raise ValueError(
        f"NVFP4 block scale shape {list(shape)} fits neither the swizzled layout {list(padded)} "
        f"nor the plain layout [{rows}, {blocks_per_row}]"
    )


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out_shape: tuple[int, int],
    *,
    pre_quant_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    hi_first: bool = True,
    swizzled: bool | None = None,
) -> torch.Tensor:
    """Dense [out, in] weight from an NVFP4 triple (+ optional AWQ pre_quant_scale folded in)."""
    rows, cols = out_shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"NVFP4 in_features {cols} is not a multiple of {BLOCK_SIZE}")
    if packed.dim() != 2 or packed.shape[0] < rows or packed.shape[1] * 2 < cols:
        raise ValueError(f"NVFP4 weight shape {list(packed.shape)} cannot hold a [{rows}, {cols}] matrix")
    blocks = cols // BLOCK_SIZE
    # Padded rows (to 16) carry their own scales in the swizzled tensor; use the stored row count.
    stored_rows = packed.shape[0]
    if swizzled is None:
        try:
            swizzled = block_scales_are_swizzled(tuple(block_scale.shape), stored_rows, packed.shape[1] * 2 // BLOCK_SIZE)
            scale_rows, scale_blocks = stored_rows, packed.shape[1] * 2 // BLOCK_SIZE
        except ValueError:
            swizzled = block_scales_are_swizzled(tuple(block_scale.shape), rows, blocks)
            scale_rows, scale_blocks = rows, blocks
    else:
        scale_rows, scale_blocks = stored_rows, packed.shape[1] * 2 // BLOCK_SIZE
    if swizzled:
        scales = unswizzle_block_scales(block_scale, scale_rows, scale_blocks)
    else:
        scales = block_scale.reshape(-1, block_scale.shape[-1])
    scales = scales[:rows, :blocks].float()
    values = unpack_e2m1(packed[:rows], hi_first=hi_first)[:, :cols]
    g = global_scale if isinstance(global_scale, float) else global_scale.float().reshape(())
    # Same association as comfy-kitchen (global * block first), so fp32 results match it bitwise.
    total = g * scales
    w = (values.reshape(rows, blocks, BLOCK_SIZE) * total.unsqueeze(-1)).reshape(rows, cols)
    if pre_quant_scale is not None:
        if pre_quant_scale.numel() != cols:
            raise ValueError(f"pre_quant_scale has {pre_quant_scale.numel()} entries, expected in_features {cols}")
        # AWQ: y = (x * s) @ Wq^T  ==  x @ (Wq * s[None, :])^T
        w = w * pre_quant_scale.float().reshape(1, cols)
    return w.to(dtype)
