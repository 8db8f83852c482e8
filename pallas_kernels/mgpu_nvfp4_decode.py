"""The E2M1 -> bf16 decode of the Mosaic GPU NVFP4 kernel (pallas_kernels/mgpu_nvfp4.py): inline
Mosaic GPU that turns a permuted tile in shared memory (layout: mgpu_nvfp4_layout) into the bf16
weights of the wgmma register layout. Each pair of weights is unmasked from its word (PAIR_ASM)
and scaled by one fma.rn.bf16x2 with its block's (s, s) pattern (code * 0x00100010 +
0x75807580): exact e2m1 * scale * 2^-8 in bf16."""

from __future__ import annotations

import numpy as np

from pallas_kernels.mgpu_nvfp4_layout import CODE_BYTES, PAIR_ASM, PAIR_SLOTS, TILE_K, TILE_ROWS


def decode_tile(tile_ref, warpgroup_stride: int = 0):
    """Inline Mosaic GPU: a permuted tile in shared memory (uint8 [72, 128]) -> the [64, 256]
    bf16 weights (e2m1 * scale * 2^-8) in the wgmma register layout. warpgroup_stride: the tile
    of warpgroup w (thread index // 128) starts w * warpgroup_stride bytes into tile_ref."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    vec4 = ir.VectorType.get((4,), i32)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())

    def const(v):
        return arith.constant(i32, v)

    tid = utils.thread_idx()
    thread = arith.andi(tid, const(127))
    lane = arith.andi(tid, const(31))
    row0 = arith.addi(arith.muli(arith.andi(arith.shrui(tid, const(5)), const(3)), const(16)),
                      arith.shrui(lane, const(2)))
    base = utils.memref_ptr(tile_ref)
    if warpgroup_stride:
        base = utils.getelementptr(
            base, [arith.muli(arith.shrui(tid, const(7)), const(warpgroup_stride))], i8)

    def load16(offset):
        return llvm.load(vec4, utils.getelementptr(base, [offset], i8), alignment=16)

    words = []
    for group in range(4):
        vec = load16(arith.addi(const(group * 2048), arith.muli(thread, const(16))))
        words += [llvm.extractelement(vec, const(j)) for j in range(4)]
    scale_rows, patterns = {}, {}

    def pattern(h, block):  # made at first use (short live ranges)
        if h not in scale_rows:
            row = arith.addi(row0, const(8 * h))
            scale_rows[h] = load16(arith.addi(const(CODE_BYTES), arith.muli(row, const(16))))
        if (h, block) not in patterns:
            word = llvm.extractelement(scale_rows[h], const(block // 4))
            code = arith.andi(arith.shrui(word, const(8 * (block % 4))), const(255))
            patterns[(h, block)] = arith.addi(arith.muli(code, const(0x00100010)),
                                              const(0x75807580))
        return patterns[(h, block)]

    out = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, TILE_K)), dtype=object)
    if out.shape != (1, 32, 1, 1, 2, 1, 1, 1, 1):
        raise NotImplementedError(f"wgmma layout registers {out.shape}")
    for i, word in enumerate(words):
        for k, (c_half, h) in enumerate(PAIR_SLOTS):
            asm = ("{\n.reg .b32 t, u, z;\n" + PAIR_ASM[k]
                   + "\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, t, $2, z;\n}")
            decoded = llvm.inline_asm(i32, [word, pattern(h, i)], asm, "=r,r,r")
            out[0, 2 * i + c_half, 0, 0, h, 0, 0, 0, 0] = utils.bitcast(decoded, bf16x2)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
