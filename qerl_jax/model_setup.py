"""The model a config describes: the (quantized) base model and its tokenizer, built from an HF
checkpoint, a GGUF file, a preset with the cached supervised warm-up, or random weights, with
the attention implementation and the Pallas kernels the config asks for. Used by the trainer
and by evaluate.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import ml_collections

from qerl_jax.infra.device_offload import compact_module
from qerl_jax.models.char_tokenizer import build_char_tokenizer
from qerl_jax.models.config import preset
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.models.tokenizer import load_tokenizer
from qerl_jax.models.transformer import (CausalLM, init_model, set_attention_implementation,
                                         set_attention_mesh, set_attention_query_chunk)
from qerl_jax.parallel.mesh import place_parameter as place_on_mesh
from qerl_jax.quant.formats import get_format

logger = logging.getLogger(__name__)


def build_model(config: ml_collections.ConfigDict, workdir: str, *, mesh=None,
                interpret: bool = False, tile_k: int | None = None):
    """The quantized base model + tokenizer as the config describes (warm-up cached), with the
    weights in the Pallas kernels' layout on GPU; `mesh`: the device mesh the model's programs
    will run on (the trainer's Placement.mesh; None: one device), where the kernels run per
    device. `interpret`: the kernels in Pallas interpret mode (CPU checks of the kernel path);
    `tile_k`: K tile of every weight's kernel layout (None: each weight's default)."""
    from qerl_jax.model_quant.quantize import load_quantized_hf_model, quantize_model
    from qerl_jax.model_quant.random_model import random_quantized_model
    from qerl_jax.warmup import cached_warmup_model

    model_cfg, fmt = config.model, config.quant.format
    quantized = get_format(fmt).is_quantized
    place = _placement(mesh)
    finish = functools.partial(_finish_model, config=config, mesh=mesh, interpret=interpret,
                               tile_k=tile_k)
    if model_cfg.hf_path:
        tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.hf_path)
        if not quantized:
            model = load_hf_model(model_cfg.hf_path, param_dtype=model_cfg.param_dtype,
                                  compute_dtype=model_cfg.compute_dtype, remat=model_cfg.remat,
                                  place=place)
        else:
            model, _ = load_quantized_hf_model(model_cfg.hf_path, fmt,   # logs its report
                                               compute_dtype=model_cfg.compute_dtype,
                                               remat=model_cfg.remat, place=place)
        return finish(model), tokenizer
    if model_cfg.gguf_path:
        from qerl_jax.models.gguf_io import load_gguf_model, load_gguf_tokenizer

        tokenizer = (load_tokenizer(model_cfg.tokenizer_path) if model_cfg.tokenizer_path
                     else load_gguf_tokenizer(model_cfg.gguf_path))
        # a 4-bit format quantizes from bf16 weights, as load_quantized_hf_model does
        param_dtype = "bfloat16" if quantized else model_cfg.param_dtype
        model = load_gguf_model(model_cfg.gguf_path, param_dtype=param_dtype,
                                compute_dtype=model_cfg.compute_dtype, remat=model_cfg.remat)
        if quantized:
            quantize_model(model, fmt)   # logs its report
        return finish(model), tokenizer
    architecture = preset_architecture(config)

    def make_model():
        return init_model(architecture, seed=config.seed)

    if config.warmup.steps > 0:
        model, tokenizer = cached_warmup_model(
            os.path.join(workdir, "warmup"), make_model, build_char_tokenizer,
            steps=config.warmup.steps, learning_rate=config.warmup.learning_rate,
            batch_size=config.warmup.batch_size, seed=config.seed,
            prompt_style=config.data.prompt_style,
            max_operand=config.data.arithmetic_max_operand)
        quantize_model(model, fmt)   # logs its report
    else:
        # Random weights (shape-only runs, GPU benchmarks): drawn and quantized tensor by
        # tensor, so a large model never exists in bf16 on the way to 4 bits.
        if not model_cfg.tokenizer_path:
            raise ValueError("config.model.tokenizer_path is required for a preset model "
                             "without warm-up")
        model = random_quantized_model(architecture, fmt, seed=config.seed, place=place)
        tokenizer = load_tokenizer(model_cfg.tokenizer_path)
    if tokenizer.vocab_size > architecture.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                         f"{architecture.vocab_size}")
    return finish(model), tokenizer


def preset_architecture(config: ml_collections.ConfigDict):
    """The ModelConfig of config.model.preset with the config's dtypes, remat and overrides."""
    model_cfg = config.model
    return preset(model_cfg.preset, param_dtype=model_cfg.param_dtype,
                  compute_dtype=model_cfg.compute_dtype, remat=model_cfg.remat,
                  **dict(model_cfg.overrides))


def build_random_model(config: ml_collections.ConfigDict, *, mesh=None, interpret: bool = False,
                       tile_k: int | None = None) -> CausalLM:
    """The random-weight config.model.preset model in config.quant.format, without a tokenizer
    (shape-only runs, benchmarks): drawn and quantized tensor by tensor (seed config.seed), then
    the attention and the kernels set as build_model sets them (same keywords)."""
    from qerl_jax.model_quant.random_model import random_quantized_model

    model = random_quantized_model(preset_architecture(config), config.quant.format,
                                   seed=config.seed, place=_placement(mesh))
    return _finish_model(model, config, mesh, interpret=interpret, tile_k=tile_k)


def _placement(mesh):
    """The `place` of the loaders and random_quantized_model on `mesh` (None: one device)."""
    # on a mesh each tensor of an HF checkpoint or of random weights goes to its shards as soon
    # as it is read (and quantized) or drawn, so such a model never sits whole on one device;
    # GGUF files (quantized after loading) and the warm-up's tiny models are built on one
    # device and placed by the trainer afterwards
    if mesh is not None and mesh.size > 1:
        return functools.partial(place_on_mesh, mesh=mesh)
    return None


def _finish_model(model: CausalLM, config: ml_collections.ConfigDict, mesh=None, *,
                  interpret: bool = False, tile_k: int | None = None) -> CausalLM:
    """What every path of build_model ends with: config.model.attention_query_chunk and
    attention_implementation (a preset's model.overrides entry of that name wins; the HF
    loaders and the warm-up cache do not carry them; 'auto' = cuDNN's fused attention on an
    NVIDIA GPU, the XLA one elsewhere) and the kernels."""
    overrides = dict(config.model.overrides)
    chunk = overrides.get("attention_query_chunk",
                          config.model.get("attention_query_chunk", 0))
    implementation = overrides.get("attention_implementation",
                                   config.model.get("attention_implementation", "auto"))
    if implementation == "auto" and chunk:
        implementation = "xla"   # query blocks are an option of the XLA attention only
    set_attention_query_chunk(model, 0)   # the two exclude each other: clear, then set both
    set_attention_implementation(model, implementation)
    set_attention_query_chunk(model, chunk)
    set_attention_mesh(model, mesh)
    _maybe_enable_kernels(model, config, mesh, interpret=interpret, tile_k=tile_k)
    return model


def _maybe_enable_kernels(model, config: ml_collections.ConfigDict, mesh=None, *,
                          interpret: bool = False, tile_k: int | None = None) -> None:
    """Repacks the 4-bit weights once into the Pallas kernels' layout and registers the kernels
    as config.quant.kernels says (GPU only, or any platform in interpret mode). bf16 weights get the
    decode-attention kernel only. quant.kernels.enabled=False keeps the XLA path. The kernels
    compute in bfloat16: with another compute dtype every matmul would take the XLA path and
    unpack the kernel layout again on each call, so nothing is repacked. On a `mesh` of more
    than one device every kernel runs per device on its rows; where the mesh splits the
    weights (fsdp or tensor > 1) the quantized matmuls keep the XLA path, whose sharded dots
    move far less than gathering each weight for a kernel launch, and only the decode
    attention runs as a kernel. `interpret` and `tile_k` as in build_model."""
    from qerl_jax.model_quant.kernel_setup import enable_decode_attention, enable_kernels
    from qerl_jax.quant.kernel_options import KernelOptions

    options = KernelOptions.from_config(config.quant.kernels)
    # passed only when asked, so the kernels' own defaults stay the single source
    interpreted = {"interpret": True} if interpret else {}
    layout = {} if tile_k is None else {"tile_k": tile_k}
    if not options.enabled:
        return
    if mesh is not None and (mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1):
        logger.info("Pallas matmul kernels not enabled: config.mesh %s splits the weights; the "
                    "quantized layers use the XLA path (sharded dots)", dict(mesh.shape))
        if config.model.compute_dtype == "bfloat16" and options.decode_attention:
            enable_decode_attention(options=options, mesh=mesh, **interpreted)
        return
    if not get_format(config.quant.format).is_quantized:
        if config.model.compute_dtype == "bfloat16" and options.decode_attention:
            enable_decode_attention(options=options, mesh=mesh, **interpreted)
        return
    if config.model.compute_dtype != "bfloat16":
        logger.info("Pallas kernels not enabled: model.compute_dtype=%s (they compute in "
                    "bfloat16); the quantized layers use the XLA path",
                    config.model.compute_dtype)
        return
    # the model was just built: nothing else holds it; its adapters come later (their rank
    # decides whether the NVFP4 decode launches can run the Mosaic GPU kernel)
    enable_kernels(model, options, donate=True, lora_rank=config.lora.rank, mesh=mesh,
                   **interpreted, **layout)
    compact = config.quant.kernels.compact_after_repack
    if compact == "on" or (compact == "auto" and jax.default_backend() == "gpu"):
        moved = compact_module(model)
        if moved:
            logger.info("compacted %.2f GiB of repacked weights through host memory", moved / 2**30)
        else:
            logger.warning("not enough host memory to compact the repacked weights: the device "
                           "allocator keeps the gaps the repack left")
