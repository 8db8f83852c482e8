"""The interface every quantized-matmul backend follows (after vLLM's compressed-tensors
schemes: a hardware gate that returns a reason, repack once after loading, apply).

A backend serves the formats it was made for on one platform, for min_m <= M <= max_m;
qerl_jax.quant.dispatch asks the registered ones in order, and a refusal (a sentence a user
understands) hands the launch to the next. Shapes:
x [M, K] in the compute dtype, weights [N, K] (QuantizedWeight), outputs [M, N] float32 unless
stated. lora_x_a is an unmerged LoRA's first product x @ A [M, r] (for several weights sharing
x, the members' products side by side [M, sum r_i]); lora_b [r, N] its second factor.
"""

from __future__ import annotations

import jax


class MatmulBackend:
    """One implementation of the quantized linear op. The defaults say "cannot" for every
    optional launch, so a backend overrides only what it runs."""

    name: str = "backend"
    description: str = "a quantized-matmul backend"  # what runs, in words, for the path log
    min_m: int = 1
    max_m: int | None = None
    lora_epilogue: bool = False  # apply_lora adds the LoRA product inside the launch

    def accepts(self, m: int) -> bool:
        return m >= self.min_m and (self.max_m is None or m <= self.max_m)

    def m_range(self) -> str:
        return f"[{self.min_m}, {'inf' if self.max_m is None else self.max_m}]"

    def refusal(self, weight, compute_dtype) -> str | None:
        """Why this backend cannot take `weight` at this compute dtype here, or None."""
        del weight, compute_dtype
        return None

    def launch_refusal(self, weight, lora_rank: int | None) -> str | None:
        """Why a single-weight launch of `weight` (with an unmerged LoRA of rank lora_rank, or
        None) cannot run here, beyond `refusal`, or None."""
        del weight, lora_rank
        return None

    def repack(self, weights, *, tile_k: int | None = None, donate: bool = False):
        """The weights of one launch (one weight, a gate/up pair's two views, or several
        sharing x) in this backend's layout, made once after loading, or None where this
        backend makes no layout for them (they stay as they are). tile_k, donate: the kernel
        layout's K tile and whether checkpoint buffers may be consumed (kernel_layout)."""
        del weights, tile_k, donate
        return None

    def apply(self, x: jax.Array, weight, *, compute_dtype) -> jax.Array:
        """x @ W^T -> [M, N] float32."""
        raise NotImplementedError

    def apply_backward(self, grad_output: jax.Array, weight, *, compute_dtype) -> jax.Array:
        """dy [M, N] @ W -> dx [M, K] in compute_dtype."""
        raise NotImplementedError

    def dense(self, weight, *, compute_dtype) -> jax.Array | None:
        """The dense W [N, K] that `apply` multiplies x by, for a backend that makes one (a
        dequantize-then-dot path), else None (a fused kernel decodes the weights in its
        launch)."""
        del weight, compute_dtype
        return None

    def apply_lora(self, x, weight, lora_x_a, lora_b, lora_scale, *, compute_dtype):
        """x @ W^T + lora_scale * lora_x_a @ lora_b in one launch (lora_epilogue True only)."""
        raise NotImplementedError(f"{self.name} has no LoRA epilogue")

    def group_refusal(self, weights, lora_ranks) -> str | None:
        """Why these weights (sharing x; their LoRA ranks, or None without LoRA) cannot share
        one launch, or None."""
        del weights, lora_ranks
        return f"kernel {self.name} has no grouped launch"

    def apply_grouped(self, x, weights, lora_x_a, lora_bs, lora_scales, *, compute_dtype):
        """Several weights sharing x in one launch -> tuple of [M, N_i] float32 (each with its
        LoRA product when lora_x_a is given)."""
        raise NotImplementedError

    def swiglu_refusal(self, m: int, weights, lora_ranks, lora_scales) -> str | None:
        """Why (gate, up) (their LoRA ranks and scales, or None) cannot run as one launch with
        the SwiGLU in its epilogue, or None."""
        del m, weights, lora_ranks, lora_scales
        return f"kernel {self.name} has no fused SwiGLU launch"

    def apply_swiglu(self, x, weights, lora_x_a, lora_bs, lora_scales, pair_lora_b,
                     next_lora_a=None, *, compute_dtype):
        """silu(gate product) * (up product) [M, N] in compute dtype; with next_lora_a [N, r]
        also that output @ next_lora_a [M, r] (returns the pair)."""
        raise NotImplementedError

    def swiglu_lora_b(self, weights, lora_bs):
        """The fused SwiGLU launch's LoRA B operand of (B_gate, B_up), made once outside a
        loop."""
        raise NotImplementedError
