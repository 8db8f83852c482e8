"""The experiment config: every field with its default and a one-line description (FIELDS), and
`validate_config`, which checks the whole config (types, ranges, choices, combinations, unknown
fields) before any model is built. The released scripts' hyperparameters build on it in
qerl_jax/released_configs.py.

Imports no JAX: `python -m qerl_jax.train --help` and a bad field's error need none. Every name a
user picks is checked against its registry (qerl_jax.registry, whose entries load lazily), after
the modules named in `config.imports` are imported, so a plug-in's registrations are selectable.
configs/*.py start from `base_config()` and override fields.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import ml_collections

from qerl_jax import registry
from qerl_jax.config_checks import (Field, at_least, auto_or, greater_than, in_interval,
                                    is_section, names_from, one_of, registered,
                                    suggest_field, type_problem)
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.wandb_logging import wandb_mode_problem
from qerl_jax.registry import REWARDS, TASKS

MODEL_CONFIG_FIELDS = (                                      # models.config.ModelConfig
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rms_norm_eps", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "param_dtype", "compute_dtype",
    "remat", "attention_query_chunk", "attention_implementation")
PARAM_DTYPES = ("bfloat16", "float32")
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
DECODE_BLOCK_N = (16, 32, 64)                                # DecodeTuning.block_n
ATTENTION_BLOCK_S = (16, 32, 64, 128, 256, 512)              # DecodeAttentionConfig.block_s
NUM_WARPS = (1, 2, 4, 8, 16)
# model.overrides keys build_model reads on every path; the other keys shape a preset only.
ATTENTION_OVERRIDES = ("attention_query_chunk", "attention_implementation")
# set by config.model.* fields; in model.overrides they would reach preset() twice
MODEL_FIELDS_NOT_OVERRIDES = ("param_dtype", "compute_dtype", "remat")
# config.data fields read outside their task: the warm-up's problems use the largest operand
DATA_FIELDS_READ_BY_WARMUP = ("arithmetic_max_operand",)

# ----------------------------------------------------------------------------- the schema
FIELDS: dict[str, Field] = {
    "seed": Field(0, "Random seed: LoRA init, rollouts, AQN noise, data order, arithmetic "
                  "problems and the warm-up all draw from keys split from it.", at_least(0)),
    "imports": Field((), "Plug-in modules imported before validation, so that the formats, "
                     "losses, rewards, tasks, ... they register can be selected by name."),
    "compilation_cache_dir": Field(
        "", "JAX persistent compilation cache directory ('' = off): runs of the same shapes "
        "load their compiled programs instead of compiling them again."),
    "xla_autotune_results": Field(
        "", "XLA GPU autotuning results file ('' = off): loaded when present, rewritten after "
        "each compilation, so every process picks the same kernels (same tokens per seed)."),
    "cpu_threads": Field(0, "CPUs this process may use (0 = all), set before JAX starts: "
                         "XLA:CPU's results depend on its thread count.", at_least(0)),
    "xla_flags": Field("", "Flags added to XLA_FLAGS before JAX starts (e.g. "
                       "--xla_cpu_enable_platform_dependent_math=false)."),
    # model
    "model.preset": Field("", "Architecture preset of a model built from scratch "
                          "(models.config.PRESETS); set this or model.hf_path.",
                          registered(registry.MODEL_PRESETS, allow_empty=True)),
    "model.hf_path": Field("", "Local HF checkpoint directory (config.json + *.safetensors) "
                           "to load and quantize; set this or model.preset."),
    "model.gguf_path": Field("", "Local llama GGUF file to load (dequantized) and quantize, "
                             "with its tokenizer; set this, model.hf_path or model.preset."),
    "model.tokenizer_path": Field("", "Tokenizer directory ('' = model.hf_path's or "
                                  "model.gguf_path's); needed by a preset model without "
                                  "warm-up."),
    "model.overrides": Field({}, "ModelConfig fields replacing the preset's (e.g. hidden_size); "
                             "attention_query_chunk / attention_implementation here win."),
    "model.param_dtype": Field("bfloat16", "Storage dtype of the unquantized parameters.",
                               one_of(PARAM_DTYPES)),
    "model.compute_dtype": Field("bfloat16", "Dtype of activations and matmuls (norms, softmax "
                                 "and logits are float32; the GPU kernels need bfloat16).",
                                 one_of(COMPUTE_DTYPES)),
    "model.remat": Field(True, "Recompute each decoder layer in the backward pass "
                         "(jax.checkpoint): less activation memory, more compute."),
    "model.attention_query_chunk": Field(
        0, "XLA training attention over blocks of this many queries (0 = all at once); "
        "needs attention_implementation 'xla' or 'auto'.", at_least(0)),
    "model.attention_implementation": Field(
        "auto", "Training attention: 'cudnn' (fused flash attention, NVIDIA GPU, bf16/fp16), "
        "'xla', or 'auto' (cudnn where it can run, else xla).",
        one_of(ATTENTION_IMPLEMENTATIONS)),
    # warmup
    "warmup.steps": Field(0, "Supervised warm-up steps on the arithmetic task for a preset "
                          "model from scratch, cached in the workdir (0 = off).", at_least(0)),
    "warmup.learning_rate": Field(1e-3, "Learning rate of the supervised warm-up.",
                                  greater_than(0)),
    "warmup.batch_size": Field(64, "Problems per supervised warm-up step.", greater_than(0)),
    # quant
    "quant.format": Field("nvfp4", "Weight format of the frozen base model ('bf16' = not "
                          "quantized).", registered(registry.FORMATS)),
    "quant.kernels.enabled": Field(True, "Use the Pallas GPU kernels for the 4-bit matmuls and "
                                   "decode attention (a no-op on CPU; False keeps the XLA path)."),
    "quant.kernels.gate_up_pairs": Field(True, "Each MLP's gate and up weights form one "
                                         "interleaved copy that decode runs in one launch with "
                                         "the SwiGLU in its epilogue."),
    "quant.kernels.mosaic_nvfp4": Field("auto", "NVFP4 decode launches on the Mosaic GPU kernel: "
                                        "'auto' where it runs (Hopper), 'on' the same with a "
                                        "warning where it cannot, 'off' the Triton kernels.",
                                        registered(registry.SWITCH)),
    "quant.kernels.mosaic_prefetch_tiles": Field(1, "K tiles per program of the next Mosaic "
                                                 "decode launch each launch prefetches into L2 "
                                                 "(0 = no prefetch).", in_interval(0, 3)),
    "quant.kernels.mosaic_schedule": Field(
        "auto", "Schedule of the Mosaic decode launches: 'auto' = warp-specialized (two compute "
        "warpgroups share each activation tile, a third issues the copies) from 33 rows where "
        "a split-K program with its LoRA tiles leaves room for no second one per SM, split-K "
        "elsewhere; 'split_k' = always split-K; 'warp_specialized' = every launch whose 64-row "
        "tiles pair up.",
        registered(registry.MOSAIC_SCHEDULES)),
    "quant.kernels.mosaic_swiglu_epilogue_max_m": Field(
        16, "The most rows (sequences in a decode step) at which a Mosaic gate|up launch "
        "computes the SwiGLU and the next LoRA x @ A in its epilogue; with more, XLA computes "
        "them from the launch's output (0 = never).", in_interval(0, 64)),
    "quant.kernels.compact_after_repack": Field(
        "auto", "After repacking the 4-bit weights for the kernels, copy them through host "
        "memory once so the device allocator holds them without the repack's gaps; needs host "
        "memory for the weights ('auto' = on a GPU).", registered(registry.SWITCH)),
    "quant.kernels.decode_attention": Field(True, "The Pallas decode-attention kernel for "
                                            "one-token decode steps."),
    "quant.kernels.decode_matmul.target_programs": Field(
        640, "Triton decode launches (M <= 16): split-K aims at about this many programs.",
        greater_than(0)),
    "quant.kernels.decode_matmul.min_tiles_per_split": Field(
        4, "Fewest K tiles a split-K program keeps.", at_least(1)),
    "quant.kernels.decode_matmul.no_split_programs": Field(
        264, "No split-K when the N tiles alone give this many programs.", at_least(1)),
    "quant.kernels.decode_matmul.max_split": Field(8, "Most K splits of a decode launch.",
                                                   at_least(1)),
    "quant.kernels.decode_matmul.block_n": Field(64, "Output columns per program.",
                                                 one_of(DECODE_BLOCK_N)),
    "quant.kernels.decode_matmul.num_warps": Field(4, "Triton warps per program.",
                                                   one_of(NUM_WARPS)),
    "quant.kernels.decode_matmul.num_stages": Field(3, "Triton pipeline stages.", at_least(1)),
    "quant.kernels.decode_matmul.weight_as_lhs": Field(
        "auto", "Left dot operand: 'auto' (per format), 'weights' or 'activations'.",
        registered(registry.WEIGHT_AS_LHS)),
    "quant.kernels.decode_matmul.decoder": Field(
        "auto", "In-kernel 4-bit decoder ('auto' = the format's GPU default).",
        auto_or(registry.KERNEL_DECODERS)),
    "quant.kernels.decode_attention_tiling.block_s": Field(
        64, "Decode attention: cache slots per loop step (a power of two >= 16).",
        one_of(ATTENTION_BLOCK_S)),
    "quant.kernels.decode_attention_tiling.splits": Field(
        0, "Decode attention: sequence splits (0 = about 2 waves of the device's SMs).",
        at_least(0)),
    "quant.kernels.decode_attention_tiling.balanced": Field(
        True, "Decode attention: split the used cache slots evenly at run time (False: fixed "
        "ranges of the cache)."),
    "quant.kernels.decode_attention_tiling.num_warps": Field(
        4, "Decode attention: Triton warps per program.", one_of(NUM_WARPS)),
    "quant.kernels.decode_attention_tiling.num_stages": Field(
        3, "Decode attention: Triton pipeline stages.", at_least(1)),
    # lora
    "lora.rank": Field(16, "LoRA rank r.", greater_than(0)),
    "lora.alpha": Field(16.0, "LoRA alpha; the adapter's output is scaled by alpha / rank.",
                        greater_than(0)),
    "lora.target_modules": Field(registry.LORA_PROJECTIONS.names(), "Projections that get "
                                 "LoRA adapters.",
                                 names_from(registry.LORA_PROJECTIONS, allow_empty=True)),
    "lora.train_norms": Field(True, "Also train the decoder layers' RMSNorm scales (QeRL "
                              "ln=True; AQN's noise lives in them)."),
    # aqn
    "aqn.enabled": Field(False, "Adaptive quantization noise on the rollout policy's norm "
                         "scales (QeRL section 3.3; quantized formats only)."),
    "aqn.schedule": Field("released_code", "Noise schedule: 'released_code' (the released "
                          "scripts) or 'paper' (the paper's equation).",
                          registered(registry.AQN_SCHEDULES)),
    "aqn.sigma_start": Field(1e-2, "Noise std of the first noisy stage (> 0, >= sigma_end).",
                             greater_than(0)),
    "aqn.sigma_end": Field(1e-4, "Noise std of the last stage; the std decays exponentially "
                           "from sigma_start.", greater_than(0)),
    "aqn.stages": Field(10, "Stages K of the schedule over train.total_steps (the first is "
                        "noise-free).", at_least(3)),
    "aqn.apply_in_training": Field(False, "Also add the noise to the base model in the gradient "
                                   "pass (off: only the rollouts are noisy)."),
    # data
    "data.task": Field("gsm8k", "Task: 'gsm8k' or 'math' (read from data.path) or "
                       "'arithmetic' (generated problems).", registered(TASKS)),
    "data.path": Field("", "A .jsonl/.parquet file or a hub dataset name ('owner/name'); "
                       "required by gsm8k and math, refused by arithmetic."),
    "data.split": Field("train", "Split of a hub dataset (a local file is one split: keep "
                        "'train')."),
    "data.subset": Field("", "Configuration (subset) of a hub dataset ('' = its default)."),
    "data.limit": Field(0, "Use only the first N examples (0 = all).", at_least(0)),
    "data.arithmetic_count": Field(1000, "Number of generated problems of the arithmetic task.",
                                   greater_than(0)),
    "data.arithmetic_max_operand": Field(20, "Largest operand of the arithmetic problems (the "
                                         "task's and the warm-up's).", greater_than(0)),
    "data.arithmetic_phrasing": Field("expression", "Arithmetic questions as '7+5=' "
                                      "('expression') or 'What is 7 + 5?' ('question', for "
                                      "instruct models).",
                                      registered(registry.ARITHMETIC_PHRASINGS)),
    "data.prompt_style": Field("paper", "'paper' appends QeRL's think/answer instruction, "
                               "'system' puts it in a system message, 'plain' adds nothing.",
                               registered(registry.PROMPT_STYLES)),
    "data.use_chat_template": Field(True, "Wrap each prompt in the tokenizer's chat template."),
    "data.max_prompt_length": Field(256, "Prompt tokens kept (longer prompts are "
                                    "left-truncated, with a warning).", greater_than(0)),
    # rollout
    "rollout.num_generations": Field(8, "Completions G sampled per prompt (group advantages "
                                     "need G >= 2).", at_least(2)),
    "rollout.max_new_tokens": Field(2048, "Completion length limit in tokens.", greater_than(0)),
    "rollout.temperature": Field(1.0, "Sampling temperature of the rollouts and of the "
                                 "log-prob passes (> 0).", greater_than(0)),
    "rollout.top_p": Field(1.0, "Nucleus sampling mass kept (1.0 = off).",
                           in_interval(0, 1, low_open=True)),
    "rollout.top_k": Field(0, "Most likely tokens kept when sampling (0 = off).", at_least(0)),
    "rollout.prompt_bucket": Field(64, "Prompts are left-padded to a multiple of this length "
                                   "(power-of-two buckets above), bounding compilations.",
                                   greater_than(0)),
    "rollout.kv_cache_dtype": Field(
        "auto", "KV cache of the training rollouts (evaluation keeps the compute dtype): "
        "'auto' = the compute dtype, 'int8' / 'float8_e4m3fn' = 8-bit codes with a float32 "
        "scale per token and kv head (half the bytes).",
        registered(registry.KV_CACHE_DTYPES)),
    "rollout.dequantize_once": Field(
        False, "A rollout whose batch (prompts x generations) takes a dequantize-then-dot path "
        "(more than 64 rows with the 4-bit kernels; every batch without them) dequantizes each "
        "weight once after the prefill instead of at every decode step: faster, for the bf16 "
        "weights' memory during the decode loop."),
    "rollout.shrink_batch": Field(
        False, "The decode loop drops finished rows: whenever at most half its rows still "
        "generate it goes on with half as many (their KV cache rows gathered) while the half "
        "is >= shrink_min_rows (one device only); each row then draws from its own key "
        "(other tokens than with it off)."),
    "rollout.shrink_min_rows": Field(8, "The smallest batch shrink_batch halves down to (each "
                                     "size is one more decode loop to compile).",
                                     greater_than(0)),
    "rollout.offload_weights_for_compile": Field(
        "auto", "Hold the frozen weights in host memory while a sampler program compiles "
        "('auto' = on a GPU).", registered(registry.SWITCH)),
    "rollout.offload_method": Field("auto", "Where the weights wait meanwhile ('auto' = "
                                    "'numpy').", registered(registry.OFFLOAD_METHODS)),
    # train
    "train.total_steps": Field(100, "Optimizer steps of the run.", greater_than(0)),
    "train.prompts_per_step": Field(16, "Prompts P per step (P * G completions).",
                                    greater_than(0)),
    "train.micro_batch_size": Field(8, "Completions per gradient micro-batch; must divide "
                                    "prompts_per_step * num_generations.", greater_than(0)),
    "train.num_iterations": Field(1, "Optimizer updates per rollout batch (> 1: PPO-style "
                                  "reuse with the clipped ratio).", at_least(1)),
    "train.learning_rate": Field(1e-5, "Peak AdamW learning rate (linear warm-up, cosine "
                                 "decay to 0).", greater_than(0)),
    "train.warmup_ratio": Field(0.1, "Fraction of total_steps of linear learning-rate "
                                "warm-up.", in_interval(0, 1, high_open=True)),
    "train.weight_decay": Field(0.1, "AdamW weight decay (LoRA matrices only).", at_least(0)),
    "train.adam_b1": Field(0.9, "AdamW beta1.", in_interval(0, 1, high_open=True)),
    "train.adam_b2": Field(0.99, "AdamW beta2.", in_interval(0, 1, high_open=True)),
    "train.max_grad_norm": Field(0.2, "Gradients are clipped to this global norm.",
                                 greater_than(0)),
    "train.max_consecutive_nonfinite": Field(5, "Stop after this many consecutive steps with a "
                                             "non-finite loss or gradient (each is skipped).",
                                             at_least(1)),
    "train.dynamic_sampling": Field(False, "DAPO dynamic sampling: drop groups whose rewards "
                                    "are all equal and sample replacements."),
    "train.dynamic_sampling_max_tries": Field(4, "Rollout batches a step samples at most while "
                                              "refilling dropped groups.", at_least(1)),
    "train.logits_chunk_size": Field(256, "Completion tokens per chunk of the log-prob pass "
                                     "(0 = the whole completion at once).", at_least(0)),
    # loss
    "loss.loss_type": Field("micro_batch_token_mean", "Policy-loss aggregation over tokens "
                            "(rl.losses; grpo/bnpo/dr_grpo/dapo are aliases).",
                            registered(registry.LOSS_NORMALIZERS)),
    "loss.policy_objective": Field("clipped_surrogate", "Per-token policy loss "
                                   "(rl.objectives): 'clipped_surrogate' = PPO's clipped ratio "
                                   "with the clip range below, 'gspo' / 'gspo_token' = GSPO's "
                                   "clipped sequence ratio, 'cispo' = CISPO's capped ratio "
                                   "weighting log pi.", registered(registry.POLICY_OBJECTIVES)),
    "loss.advantage_estimator": Field("group_normalized", "Rewards -> advantages "
                                      "(rl.advantages): 'group_normalized' = GRPO's (r - group "
                                      "mean) / (group std + 1e-4), 'mean_centered' = Dr. GRPO's "
                                      "r - group mean, 'rloo' = r - mean of the group's other "
                                      "rewards (grpo/drgrpo are aliases).",
                                      registered(registry.ADVANTAGE_ESTIMATORS)),
    "loss.gspo_epsilon_low": Field(3e-4, "gspo/gspo_token: sequence ratios below 1 - this are "
                                   "clipped (GSPO's value).", in_interval(0, 1, high_open=True)),
    "loss.gspo_epsilon_high": Field(4e-4, "gspo/gspo_token: sequence ratios above 1 + this are "
                                    "clipped (GSPO's value).", at_least(0)),
    "loss.cispo_epsilon_max": Field(5.0, "cispo: the cap on each token's ratio pi / pi_old "
                                    "(TRL's recommended value).", greater_than(0)),
    "loss.epsilon_low": Field(0.2, "Lower clip range: ratios below 1 - epsilon_low are "
                              "clipped.", in_interval(0, 1, high_open=True)),
    "loss.epsilon_high": Field(0.28, "Upper clip range: ratios above 1 + epsilon_high are "
                               "clipped (DAPO clip-higher).", at_least(0)),
    "loss.beta": Field(0.0, "Weight of the k3 KL term against the LoRA-disabled model "
                       "(0 = off).", at_least(0)),
    "loss.rollout_correction": Field("none", "Weight each token's policy loss by r = pi_old / "
                                     "pi_rollout per token (token_*) or per sequence "
                                     "(sequence_*), truncated to min(r, C) (*_truncate) or 0 "
                                     "where r > C (*_mask), for the rollout policy (AQN noise, "
                                     "kernels) differing from the trained one; 'none' = off "
                                     "(rl.rollout_correction).",
                                     registered(registry.ROLLOUT_CORRECTIONS)),
    "loss.rollout_correction_cap": Field(3.0, "The cap C of loss.rollout_correction (TRL's "
                                         "default 3).", greater_than(0)),
    "loss.top_entropy_quantile": Field(1.0, "Train only on the tokens in this top fraction of "
                                       "entropies (1.0 = every token).",
                                       in_interval(0, 1, low_open=True)),
    "loss.mask_truncated_completions": Field(True, "Exclude completions cut at max_new_tokens "
                                             "from the loss."),
    # rewards
    "rewards.names": Field(("format", "gsm8k_exact"), "Reward functions, summed with weight 1 "
                           "(rewards.REWARDS).",
                           names_from(REWARDS, allow_empty=False)),
    "rewards.time_limit_seconds": Field(5.0, "Time limit of scoring one completion (0 = no "
                                        "limit, scored in-process).", at_least(0)),
    # eval
    "eval.every_steps": Field(0, "Held-out greedy pass@1 of the noise-free policy at step 0 "
                              "(the base model), every N steps and after the last (0 = off).",
                              at_least(0)),
    "eval.num_examples": Field(128, "Size of the fixed held-out subset: the first N rows of "
                               "the test split, in file order.", greater_than(0)),
    "eval.data_path": Field("", "Test split: a .jsonl/.parquet file or a hub dataset (its "
                            "'test' split); '' = data.path's 'test' split (arithmetic: "
                            "generated problems outside the training set)."),
    "eval.max_new_tokens": Field(0, "Completion length limit of the evaluation (0 = "
                                 "rollout.max_new_tokens).", at_least(0)),
    "eval.batch_size": Field(32, "Prompts per evaluation batch.", greater_than(0)),
    # checkpoint
    "checkpoint.every_steps": Field(50, "Save a checkpoint every N steps (and at exit).",
                                    greater_than(0)),
    "checkpoint.max_to_keep": Field(2, "Checkpoints kept in the workdir.", at_least(1)),
    # logging
    "logging.tensorboard": Field(True, "TensorBoard event files next to metrics.jsonl when "
                                 "tensorboardX is installed."),
    "logging.progress_bar": Field(True, "Show a tqdm progress bar."),
    "logging.samples.every_steps": Field(10, "Every N steps, record sample completions in "
                                         "samples.jsonl, TensorBoard and W&B (0 = off).",
                                         at_least(0)),
    "logging.samples.count": Field(4, "Completions per recorded step (a seeded choice of the "
                                   "step's batch).", greater_than(0)),
    "logging.wandb.mode": Field("off", "Weights & Biases logging: 'online', 'offline' (synced "
                                "later with `wandb sync`) or 'off'; needs the wandb extra.",
                                wandb_mode_problem),
    "logging.wandb.project": Field("qerl-jax", "W&B project of the run."),
    "logging.wandb.run_name": Field("", "W&B run name ('' = the run directory's name)."),
    # mesh (qerl_jax.parallel.mesh): the product of the three sizes is jax.device_count()
    "mesh.data": Field(1, "Devices along the data axis: rollout prompts, KV cache and "
                       "training rows are split over them.", greater_than(0)),
    "mesh.fsdp": Field(1, "Devices along the FSDP axis: params, optimizer state and 4-bit "
                       "weights (and training rows) are split over them.", greater_than(0)),
    "mesh.tensor": Field(1, "Devices along the tensor axis: attention heads, MLP columns and "
                         "the vocabulary are split over them.", greater_than(0)),
    # distributed (qerl_jax.parallel.distributed): several processes, one per host
    "distributed.initialize": Field("auto", "jax.distributed.initialize first: 'auto' when "
                                    "SLURM / Open MPI or distributed.coordinator_address say "
                                    "so, 'on' always, 'off' never.", registered(registry.SWITCH)),
    "distributed.coordinator_address": Field("", "host:port of process 0's coordinator ('' = "
                                             "from the cluster's environment)."),
    "distributed.num_processes": Field(0, "Processes of the run (0 = from the cluster's "
                                       "environment).", at_least(0)),
    "distributed.process_id": Field(-1, "This process's index (-1 = from the cluster's "
                                    "environment).", at_least(-1)),
}
# fields holding a mapping whose keys the config chooses (checked separately)
MAPPING_FIELDS = ("model.overrides",)


def field_defaults() -> dict[str, Any]:
    """'FIELD' (dotted path) -> its default, in schema order."""
    return {path: field.default for path, field in FIELDS.items()}


def field_descriptions() -> dict[str, str]:
    """'config.FIELD' -> its one-line description, in schema order."""
    return {f"config.{path}": field.description for path, field in FIELDS.items()}


def base_config() -> ml_collections.ConfigDict:
    """Every field of FIELDS at its default."""
    tree: dict = {}
    for path, field in FIELDS.items():
        *sections, name = path.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = copy.deepcopy(field.default)
    return ml_collections.ConfigDict(tree)


# ----------------------------------------------------------------------------- validation
def _fail(path: str, problem: str) -> ConfigError:
    return ConfigError(f"config.{path}: {problem}")


def config_leaves(config, prefix: str = "",
                  mapping_fields: tuple[str, ...] = MAPPING_FIELDS) -> dict[str, Any]:
    """'a.b.c' -> value for every leaf of a (nested) ConfigDict; the fields named in
    `mapping_fields` count as leaves (their value is the mapping). An empty section that is not
    such a field is a leaf too (an unknown name shows up)."""
    leaves: dict[str, Any] = {}
    for name in config.keys():
        value = config[name]
        path = f"{prefix}{name}"
        if is_section(value) and path not in mapping_fields and len(value):
            leaves.update(config_leaves(value, f"{path}.", mapping_fields))
        else:
            leaves[path] = value
    return leaves


def _check_fields(config) -> None:
    """Unknown and missing fields, then each field's type and value."""
    leaves = config_leaves(config)
    sections = {path.rsplit(".", 1)[0] for path in FIELDS if "." in path}
    for path, value in leaves.items():
        if path in FIELDS:
            continue
        if path in sections:
            raise _fail(path, f"must be a section of fields, got {value!r}")
        raise _fail(path, "unknown field" + suggest_field(path, FIELDS))
    for path in FIELDS:
        if path not in leaves:
            raise _fail(path, "missing; start the config from "
                              "qerl_jax.experiment_config.base_config()")
    for path, field in FIELDS.items():
        problem = type_problem(leaves[path], field.default) or field.check(leaves[path])
        if problem:
            raise _fail(path, problem)


def _check_model(config) -> None:
    model, warmup = config.model, config.warmup
    if model.gguf_path and (model.hf_path or model.preset):
        other = (f"model.hf_path ({model.hf_path!r}, an HF checkpoint)" if model.hf_path
                 else f"model.preset ({model.preset!r}, a model built from scratch)")
        raise _fail("model.gguf_path", f"set {other} or model.gguf_path (a GGUF file), not "
                    "both")
    if model.preset and model.hf_path:
        raise _fail("model.hf_path", f"set model.preset ({model.preset!r}, a model built from "
                    "scratch) or model.hf_path (a checkpoint), not both")
    if not model.preset and not model.hf_path and not model.gguf_path:
        raise _fail("model.preset", "set model.preset (a model built from scratch) or "
                    "model.hf_path (a local HF checkpoint directory) or model.gguf_path (a "
                    "local GGUF file)")
    overrides = dict(model.overrides)
    for key in overrides:
        if key not in MODEL_CONFIG_FIELDS:
            raise _fail(f"model.overrides.{key}", "not a ModelConfig field"
                        + suggest_field(f"model.overrides.{key}",
                                        [f"model.overrides.{name}"
                                         for name in MODEL_CONFIG_FIELDS]))
        if key in MODEL_FIELDS_NOT_OVERRIDES:
            raise _fail(f"model.overrides.{key}", f"set config.model.{key} instead")
        if model.hf_path and key not in ATTENTION_OVERRIDES:
            raise _fail(f"model.overrides.{key}", "shapes a preset model only; model.hf_path's "
                        "config.json sets the architecture")
        if model.gguf_path and key not in ATTENTION_OVERRIDES:
            raise _fail(f"model.overrides.{key}", "shapes a preset model only; model.gguf_path's "
                        "metadata sets the architecture")
    chunk = overrides.get("attention_query_chunk", model.attention_query_chunk)
    implementation = overrides.get("attention_implementation", model.attention_implementation)
    if chunk and implementation == "cudnn":
        raise _fail("model.attention_query_chunk", f"{chunk} applies to the 'xla' attention "
                    "only; attention_implementation='cudnn' never materializes the scores")
    if model.hf_path:
        if not os.path.isfile(os.path.join(model.hf_path, "config.json")):
            raise _fail("model.hf_path", f"{model.hf_path!r} is not a local HF checkpoint "
                        "directory (no config.json in it)")
        if warmup.steps:
            raise _fail("warmup.steps", f"{warmup.steps}: the supervised warm-up trains a "
                        "preset model from scratch; set 0 with model.hf_path")
    elif model.gguf_path:
        if not os.path.isfile(model.gguf_path):
            raise _fail("model.gguf_path", f"{model.gguf_path!r} is not a file")
        if warmup.steps:
            raise _fail("warmup.steps", f"{warmup.steps}: the supervised warm-up trains a "
                        "preset model from scratch; set 0 with model.gguf_path")
    elif warmup.steps and model.tokenizer_path:
        raise _fail("model.tokenizer_path", "unused: the warm-up (warmup.steps > 0) builds its "
                    "own character tokenizer; set ''")
    elif not warmup.steps and not model.tokenizer_path:
        raise _fail("model.tokenizer_path", "required for a preset model without warm-up "
                    "(warmup.steps = 0)")
    if model.tokenizer_path and not os.path.isdir(model.tokenizer_path):
        raise _fail("model.tokenizer_path", f"{model.tokenizer_path!r} is not a directory")


def _check_data(config) -> None:
    data = config.data
    task = TASKS.get(data.task)
    # the config.data fields that are some task's options and not this one's go unused
    others = {name for other in TASKS.names() for name in TASKS.get(other).options}
    unused = sorted(others - set(task.options))
    if config.warmup.steps:
        unused = [name for name in unused if name not in DATA_FIELDS_READ_BY_WARMUP]
    if task.reads_files:
        if not data.path:
            raise _fail("data.path", f"task {task.name!r} needs a .jsonl/.parquet file or a "
                        "hub dataset name")
    else:
        unused = ["path", "split", "subset"] + unused
    reads = ("it reads data.path" if task.reads_files else "it generates its problems")
    for name in unused:
        if name in data and data[name] != FIELDS[f"data.{name}"].default:
            why = ("without warm-up" if name in DATA_FIELDS_READ_BY_WARMUP else f"({reads})")
            raise _fail(f"data.{name}", f"{data[name]!r} is unused by task {task.name!r} "
                        f"{why}")
    if task.count_option and data[task.count_option] < config.train.prompts_per_step:
        raise _fail(f"data.{task.count_option}", f"{data[task.count_option]} problems are fewer "
                    f"than one step's train.prompts_per_step={config.train.prompts_per_step}")
    if data.limit and data.limit < config.train.prompts_per_step:
        raise _fail("data.limit", f"{data.limit} examples are fewer than one step's "
                    f"train.prompts_per_step={config.train.prompts_per_step}")


def _check_training(config) -> None:
    if config.aqn.enabled and not registry.FORMATS.fact(config.quant.format, "is_quantized"):
        raise _fail("aqn.enabled", "AQN is defined for quantized bases only (QeRL); use a "
                    "quantized quant.format or aqn.enabled=False")
    if config.aqn.sigma_start < config.aqn.sigma_end:
        raise _fail("aqn.sigma_end", f"{config.aqn.sigma_end!r} must be <= aqn.sigma_start="
                    f"{config.aqn.sigma_start!r} (the noise decays)")
    if not config.lora.target_modules and not config.lora.train_norms:
        raise _fail("lora.target_modules", "() with lora.train_norms=False leaves nothing to "
                    "train")
    rows = config.train.prompts_per_step * config.rollout.num_generations
    if rows % config.train.micro_batch_size:
        raise _fail("train.micro_batch_size", f"{config.train.micro_batch_size} must divide "
                    f"prompts_per_step * num_generations = {rows}")


def _check_parallel(config) -> None:
    dist = config.distributed
    explicit = (dist.coordinator_address, dist.num_processes, dist.process_id != -1)
    if any(explicit) and not all(explicit):
        raise _fail("distributed.coordinator_address", "set it with distributed.num_processes "
                    "and distributed.process_id, or none of them (the cluster's environment)")
    if dist.num_processes and not dist.process_id < dist.num_processes:
        raise _fail("distributed.process_id", f"{dist.process_id} must be < "
                    f"distributed.num_processes={dist.num_processes}")
    if any(explicit) and dist.initialize == "off":
        raise _fail("distributed.initialize", "'off' leaves distributed.coordinator_address "
                    "unused; set 'auto' or 'on'")


def import_config_plugins(config) -> None:
    """Imports the modules config.imports names: what they register becomes selectable.

    Raises:
      ConfigError: one line naming the module that failed to import and why.
    """
    modules = config.get("imports", ())
    problem = type_problem(modules, FIELDS["imports"].default)
    if problem:
        raise _fail("imports", problem)

    def refuse(module: str, error: BaseException):
        reason = (str(error).strip().splitlines() or [""])[0]
        raise _fail("imports", f"cannot import {module!r}: {type(error).__name__}: "
                    f"{reason}") from error

    registry.import_plugins(tuple(modules), refuse)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Checks the whole config before any model work: unknown and missing fields, each field's
    type and range, each name against its registry (after importing config.imports), and the
    combinations that cannot run or would ignore a field.

    Raises:
      ConfigError: one line naming the first bad field, 'config.a.b: problem'.
    """
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config must be an ml_collections.ConfigDict, got "
                          f"{type(config).__name__}")
    import_config_plugins(config)
    _check_fields(config)
    _check_model(config)
    _check_data(config)
    _check_training(config)
    _check_parallel(config)
