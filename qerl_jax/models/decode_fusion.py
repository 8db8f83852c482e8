"""The model's side of the fused decode launches: which projections run together, and in what
order the decode launches follow each other.

  q|k|v       an Attention's q, k and v projections read the same x: one grouped launch
              (layers.apply_linears); with the Mosaic GPU kernel one permuted buffer holds all
              three (the weights' only copy).
  gate|up     an MLP's gate and up weights become two views of one interleaved copy, run at
              decode in one launch with the SwiGLU in its epilogue (layers.apply_swiglu_linears).
  decode order each layer's q|k|v, o, gate|up and down launches, then the next layer's: each
              launch prefetches the next one's first weight tiles into L2 (Mosaic GPU kernel).
  dequantized a rollout whose rows take a dequantize-then-dot path (more than the fused
              kernels take) can dequantize each weight once, after the prefill, instead of
              at every decode step (dequantize_for_rollout).

How a launch runs is qerl_jax.quant's business: the layouts come from the functions passed in
(qerl_jax.model_quant.kernel_setup passes the kernel backends'), the per-rollout operands from
the weights' own `with_*` methods (QuantizedWeight: none; a kernel backend's weight type makes
its own). This module only names the layers. Everything here works in place on a Module and
leaves weights the kernels would not read as they are.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models.layers import Linear
from qerl_jax.models.transformer import MLP, Attention
from qerl_jax.quant.linear_op import dense_weight
from qerl_jax.quant.linear_swiglu import prepare_swiglu_lora_b
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)


def qkv_groups(model: nnx.Module):
    """(q, k, v) Linear layers of every Attention module (one grouped decode launch each)."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Attention):
            yield module.q_proj, module.k_proj, module.v_proj


def gate_up_pairs(model: nnx.Module):
    """(gate, up) Linear layers of every SwiGLU MLP (one fused decode launch each)."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MLP):
            yield module.gate_proj, module.up_proj


def pair_gate_up_weights(model: nnx.Module, pair: Callable) -> int:
    """In place: each MLP's gate and up weights become two views of one interleaved copy
    (`pair(gate, up)` -> ((gate view, up view), None) or (None, why not):
    qerl_jax.quant.kernel_registry.pair_weights); returns how many MLPs were paired. MLPs whose
    weights cannot pair (another format, the checkpoint layout, ...) keep separate weights,
    with the reason logged once per reason."""
    count, reasons = 0, set()
    for gate_layer, up_layer in gate_up_pairs(model):
        gate, up = gate_layer.weight.get_value(), up_layer.weight.get_value()
        if getattr(gate, "pair_view", None) is not None:
            continue
        views, refusal = pair(gate, up)
        if views is None:
            if refusal not in reasons and isinstance(gate, QuantizedWeight):
                reasons.add(refusal)
                logger.info("gate/up pairs: an MLP keeps separate weights: %s", refusal)
            continue
        gate_layer.weight.set_value(views[0])
        up_layer.weight.set_value(views[1])
        count += 1
    return count


def add_decode_layouts(model: nnx.Module, repack: Callable) -> tuple[int, int, int]:
    """In place: every quantized weight whose decode launch a kernel with its own layout can
    run (the Mosaic GPU kernel) is stored in that layout, as its only copy: each q|k|v group in
    one buffer, each gate/up pair in one, every other weight alone. `repack(weights)` gives one
    launch's weights in that layout, or None where it makes none
    (qerl_jax.quant.kernel_registry.repack_launch; MosaicBackend.repack).
    Each weight (group, pair) is converted as soon as its buffer exists, so its kernel-layout
    arrays are freed then (once nothing else references them) and the conversion needs one
    weight's (group's) memory more, not a model's. Returns (weights, pairs, groups) converted.
    """
    done, weights, pairs, groups = set(), 0, 0, 0
    for layers in qkv_groups(model):
        variables = [layer.weight for layer in layers]
        done.update(id(variable) for variable in variables)
        stored = repack([v.get_value() for v in variables])
        if stored is None:
            continue
        for variable, value in zip(variables, stored):
            variable.set_value(value)
        groups += 1
    for layers in gate_up_pairs(model):
        variables = [layer.weight for layer in layers]
        values = [v.get_value() for v in variables]
        if getattr(values[0], "pair_view", None) is None:
            continue
        done.update(id(variable) for variable in variables)
        stored = repack(values)
        if stored is not None:
            for variable, value in zip(variables, stored):
                variable.set_value(value)
            pairs += 1
            weights += 2
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable) or id(node) in done:
            continue
        value = node.get_value()
        if not isinstance(value, QuantizedWeight) or getattr(value, "pair_view", None):
            continue
        stored = repack([value])
        if stored is not None:
            node.set_value(stored[0])
            weights += 1
    return weights, pairs, groups


def stack_grouped_adapters(model: nnx.Module) -> int:
    """Sets each Attention's and MLP's `grouped_lora_a` to its q|k|v (gate|up) adapters' A
    matrices side by side, [in, sum r] in the compute dtype, in place; returns how many groups
    were stacked (those whose projections all have adapters).

    For decoding: the grouped launch multiplies x by [A_q | A_k | A_v] once, and inside the
    sampler's while_loop XLA re-ran that concatenation at every token (two concatenate kernels
    per layer and step in a GPU profile). Stacked once before the loop, the product
    reads the same values. Use it on a merged copy inside a jitted function, never on the
    trained state.

    An MLP whose gate/up weights are pair views also gets `pair_lora_b`, its fused SwiGLU
    launch's LoRA B (linear_swiglu.prepare_swiglu_lora_b, 4.6 MiB per 7B layer at rank 32), and
    every launch that takes one its LoRA operand (the weight's with_lora_operand /
    with_group_lora_operand / with_pair_lora_operand: for the Mosaic GPU kernel B^T with the
    scales folded in), which the launch would otherwise rebuild at every token.
    """
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, Linear) and layer.lora_a is not None:
            weight = layer.weight.get_value()
            if not isinstance(weight, QuantizedWeight):
                continue
            prepared = weight.with_lora_operand(layer.lora_b.get_value(), layer.lora_scale)
            if prepared is not weight:
                layer.weight.set_value(prepared)
    count = 0
    for _, module in nnx.iter_graph(model):
        if not isinstance(module, (Attention, MLP)):
            continue
        projections = ((module.q_proj, module.k_proj, module.v_proj)
                       if isinstance(module, Attention) else (module.gate_proj, module.up_proj))
        if any(layer.lora_a is None for layer in projections):
            continue
        dtype = projections[0].compute_dtype
        module.grouped_lora_a = jnp.concatenate(
            [layer.lora_a.get_value().astype(dtype) for layer in projections], axis=1)
        weights, _, loras = zip(*(layer.operands() for layer in projections))
        quantized = isinstance(weights[0], QuantizedWeight)
        if isinstance(module, Attention):
            prepared = weights[0].with_group_lora_operand(
                weights, [lora.b for lora in loras],
                [lora.scale for lora in loras]) if quantized else weights[0]
            if prepared is not weights[0]:
                module.q_proj.weight.set_value(prepared)
        else:
            module.pair_lora_b = prepare_swiglu_lora_b(weights, loras, compute_dtype=dtype)
            prepared = weights[0].with_pair_lora_operand(
                weights[1], loras[0].b, loras[1].b, loras[0].scale) if quantized else weights[0]
            if prepared is not weights[0]:
                module.gate_proj.weight.set_value(prepared)
        count += 1
    return count


def _decode_chain(model) -> list:
    """(weight variable, the LoRA A read by the x @ A before its launch) in decode order."""
    def lora_a(linear):
        variable = getattr(linear, "lora_a", None)
        return None if variable is None else variable.get_value()

    chain = []
    for layer in getattr(model, "layers", ()):
        attention, mlp = layer.self_attn, layer.mlp
        chain += [(attention.q_proj.weight, getattr(attention, "grouped_lora_a", None)),
                  (attention.o_proj.weight, lora_a(attention.o_proj)),
                  (mlp.gate_proj.weight, getattr(mlp, "grouped_lora_a", None)),
                  (mlp.down_proj.weight, lora_a(mlp.down_proj))]
    return chain


def link_decode_prefetch(model) -> int:
    """In decode order, each weight whose launch prefetches gets the next launch's weight and
    the LoRA A of the x @ A that runs before that launch (o's A, read by the attention's
    combine; the MLP's and the next attention's stacked A from stack_grouped_adapters; down's
    A), if any (the weight's with_prefetch). In place, on the sampler's merged copy (after
    stack_grouped_adapters); returns the links made."""
    chain = _decode_chain(model)
    count = 0
    for (node, _), (following, following_a) in zip(chain, chain[1:]):
        value = node.get_value()
        if not isinstance(value, QuantizedWeight):
            continue
        linked = value.with_prefetch(following.get_value(), following_a)
        if linked is not value:
            node.set_value(linked)
            count += 1
    return count


def dequantize_for_rollout(model: nnx.Module, rows: int, after: jax.Array | None = None) -> int:
    """In place: every quantized weight whose forward at M = rows would dequantize it (the XLA
    path, or a kernel backend's dequantize-then-dot path for large M) becomes that dense
    weight, made once, as a dense kernel [in, out] in its layer's compute dtype; weights a fused
    kernel takes at M = rows stay quantized. Returns how many were dequantized.

    `after`: an array the dequantization waits for (through an optimization barrier), e.g. the
    prefill's logits, so that the dense weights do not coexist with the prefill's temporaries.
    The decode loop then multiplies by the same bf16 values it would make at every step (the
    products may sum in another order). For the sampler's merged copy inside its program, when
    SamplingConfig.dequantize_once asks for it: the dense weights live for the decode loop
    (13 GB at Qwen2.5-7B), and the per-step dequantization's reads and writes are gone."""
    layers = [layer for _, layer in nnx.iter_graph(model)
              if isinstance(layer, Linear) and isinstance(layer.weight.get_value(),
                                                          QuantizedWeight)]
    weights = [layer.weight.get_value() for layer in layers]
    if after is not None and weights:   # the original weights stay for launches left as they are
        weights, _ = jax.lax.optimization_barrier((weights, after))
    count = 0
    for layer, weight in zip(layers, weights):
        dense = dense_weight(weight, rows, compute_dtype=layer.compute_dtype)
        if dense is not None:
            layer.weight.set_value(dense.T.astype(layer.compute_dtype))
            count += 1
    return count


def dequantizes_at(model: nnx.Module, rows: int) -> bool:
    """Whether an M = rows decode step of `model` dequantizes any of its quantized weights (the
    weights dequantize_for_rollout(model, rows) would make dense), found from shapes alone
    (jax.eval_shape: nothing is dequantized)."""
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, Linear) and isinstance(layer.weight.get_value(), QuantizedWeight):
            made = jax.eval_shape(
                lambda weight, layer=layer: dense_weight(weight, rows,
                                                         compute_dtype=layer.compute_dtype),
                layer.weight.get_value())
            if made is not None:
                return True
    return False


def prepare_decode(model) -> None:
    """What the sampler does to its merged copy before the decode loop: the grouped adapters
    and launch operands (stack_grouped_adapters), then the prefetch links."""
    stack_grouped_adapters(model)
    link_decode_prefetch(model)
