"""The QeRL training loop: rollout -> rewards -> advantages -> jitted train step(s).

One step (arXiv 2510.11696: AQN section 3.3, the GRPO / DAPO objective):
  1. P prompts from the seeded iterator; the rollout policy (AQN noise on its decoder norms,
     a pure function of (key, step, schedule)) samples G completions each from one prefill.
  2. Rewards (summed over reward functions) -> group advantages; optional DAPO dynamic
     sampling drops zero-variance groups and refills them.
  3. num_iterations passes of micro-batched gradient accumulation of the clipped policy loss
     (+ k3 KL against the LoRA-disabled model) on the noise-free model, then AdamW.
With config.eval.every_steps, the noise-free policy's greedy pass@1 on a fixed held-out subset
(evaluation.pass_at_1) joins the metrics row of step 0, of every N-th step and, in a row of its
own, of the step count after the last step (row k: the policy after k updates).
The model is split once: graphdef (static) / trainable (LoRA [+ norm scales]) / frozen (the
quantized base); jitted functions take the states as inputs and merge inside.
A step with no valid completion token records its per-token means (loss, entropy, KL, clip
fraction) as missing (null), not 0. The CLI's closing line gives the mean reward, accuracy and
entropy over the first and the last tenth of the run's steps (steps 0-9 and 90-99 of 100; at
least one step each; infra.metrics.run_summary).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from qerl_jax.aqn import AQNSchedule, aqn_noisy_state, aqn_sigma
from qerl_jax.infra.checkpointing import (CheckpointMismatch, TrainingCheckpoints,
                                          check_resume_meta)
from qerl_jax.infra.compilation_cache import enable_compilation_cache
from qerl_jax.experiment_config import field_defaults, validate_config
from qerl_jax.data import PromptIterator, encode_prompts
from qerl_jax.tasks import get_task, load_eval_examples, load_training_examples
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.infra.device_offload import commit_to_devices, offload_to_host, restore_to_device
from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
from qerl_jax.infra.atomic_io import storage_errors
from qerl_jax.infra.errors import ConfigError, TrainingStopped
from qerl_jax.evaluation import (decoded_completions, evaluation_due, held_out_metrics,
                                 held_out_sampling)
from qerl_jax.infra.interrupts import Interrupted, StopSignals
from qerl_jax.infra.metrics import (MetricsWriter, peak_memory_bytes, progress_bar, read_metrics,
                                    run_metadata)
from qerl_jax.infra.samples import step_samples
from qerl_jax.model_setup import build_model
from qerl_jax.models.tokenizer import decode_completion, eos_token_ids
from qerl_jax.models.transformer import CausalLM
from qerl_jax.parallel.distributed import initialize_distributed, is_primary, to_host
from qerl_jax.parallel.mesh import Placement
from qerl_jax.rewards import get_reward_functions, score_completions
from qerl_jax.plots import write_run_curves
from qerl_jax.rl.optimizer import make_optimizer
from qerl_jax.rl.train_step import make_train_programs, training_batch
from qerl_jax.infra.run_record import changes_note, check_workdir, move_aside, record_start
from qerl_jax.models.hf_io import check_hf_model_files
from qerl_jax.rl.losses import (LossConfig)
from qerl_jax.sampling import (SamplingConfig, bucket_length, compile_generate,
                               generate_from_states, padded_prompt_shape)
from qerl_jax.infra.cpu_pinning import pin_cpu_numerics
from qerl_jax.infra.xla_autotuning import persist_autotuning

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite losses or gradients."""


# ------------------------------------------------------------------------------ the trainer
class Trainer:
    """Holds the split model, optimizer, data iterator and checkpoints of one run."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
                 overwrite: bool = False, allow_config_changes: bool = False,
                 restart: bool = False):
        """Validates the config, the data, the run directory and the model files, builds the
        model, and only then changes the run directory; then the optimizer and the data
        iterator.

        Args:
          resume: continue the run in `workdir` from its newest checkpoint that restores (a
            fresh start in a directory without an earlier run's metrics); its config may change
            only harmless fields (run_record.HARMLESS_FIELDS) unless `allow_config_changes`.
            An intact checkpoint that does not fit the config is refused (ConfigError naming
            the changed fields and the shapes), nothing moved.
          overwrite: a fresh run into a `workdir` holding an earlier run moves that run's files
            into `workdir`/replaced-<UTC time>/ (the warm-up cache stays); without it such a
            start is refused.
          restart: with `resume`, a `workdir` with no checkpoint but an earlier run's metrics
            or moved-aside checkpoints starts over at step 0 (those files moved aside as with
            `overwrite`); without it such a resume is refused.
        """
        validate_config(config)
        self.config = config
        self.workdir = workdir
        # before the first JAX computation: XLA reads its flags when the backend starts
        persist_autotuning(config.get("xla_autotune_results", ""))
        pin_cpu_numerics(config.get("cpu_threads", 0), config.get("xla_flags", ""))
        enable_compilation_cache(config.get("compilation_cache_dir", ""))
        initialize_distributed(config)   # config.distributed (or SLURM's / Open MPI's launch)
        self.placement = Placement.from_config(config)   # config.mesh against the devices
        examples = load_training_examples(config)   # the data checked before any model work
        self.eval_examples = load_eval_examples(config, examples)
        self._config_dict = json.loads(config.to_json())
        # nothing in `workdir` changes before the start is checked and the model is built
        plan = check_workdir(workdir, self._config_dict, resume=resume, overwrite=overwrite,
                             allow_config_changes=allow_config_changes, restart=restart,
                             defaults=field_defaults())
        self.resume = resume and not plan.move_aside
        self._config_changes = plan.config_changes if is_primary() else []
        if config.model.hf_path:   # headers and shapes: seconds, before any weight is read
            check_hf_model_files(config.model.hf_path,
                                 config.model.tokenizer_path or config.model.hf_path)
        with storage_errors(workdir, "create the run directory"):
            os.makedirs(workdir, exist_ok=True)
        base_key = jax.random.key(config.seed)
        self.lora_key = jax.random.fold_in(base_key, 1)
        self.rollout_key = jax.random.fold_in(base_key, 2)
        self.aqn_key = jax.random.fold_in(base_key, 3)

        model, self.tokenizer = build_model(config, workdir, mesh=self.placement.mesh)
        replaced = move_aside(workdir, plan.move_aside) if is_primary() else None
        if replaced:
            logger.info("moved the earlier run's files (%s) to %s", ", ".join(plan.move_aside),
                        replaced)
        self.lora_config = LoRAConfig(rank=config.lora.rank, alpha=config.lora.alpha,
                                      target_modules=tuple(config.lora.target_modules),
                                      train_norms=config.lora.train_norms)
        add_lora(model, self.lora_config, self.lora_key)
        self.model_config = model.config
        # committed to the device from the start (same buffers): jit keys its programs on the
        # committed flag, and arrays out of jitted programs or back from host memory carry it
        self.graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
        self.trainable, self.frozen = commit_to_devices(self.placement.states((trainable, frozen)))
        del model, trainable, frozen
        # LoRA B = 0 and the original norm scales: the reference (LoRA-disabled) policy, kept
        # only when the KL term needs it (it is a copy of every adapter).
        self.reference_trainable = (jax.tree_util.tree_map(jnp.copy, self.trainable)
                                    if config.loss.beta != 0.0 else None)
        self.optimizer, self.lr_schedule = make_optimizer(config.train)
        self.opt_state = commit_to_devices(
            self.placement.states(self.optimizer.init(self.trainable)))

        self.iterator = PromptIterator(examples, config.train.prompts_per_step, config.seed)
        self.reward_functions = get_reward_functions(list(config.rewards.names))
        # the task's correctness reward decides `accuracy` and pass@1; scored on its own (not
        # summed into the reward) when the run does not train with it
        task = get_task(config.data.task)
        self.correctness_name = task.correctness_reward(config.data)
        self.correctness_function = task.correctness_function(config.data)
        self.correctness_key = (self.correctness_name if self.correctness_name
                                in self.reward_functions else f"correct:{self.correctness_name}")
        rollout = config.rollout
        self.sampling = SamplingConfig(
            max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
            top_p=rollout.top_p, top_k=rollout.top_k, num_generations=rollout.num_generations,
            prompt_bucket=rollout.prompt_bucket, kv_cache_dtype=rollout.kv_cache_dtype,
            dequantize_once=rollout.dequantize_once, shrink_batch=rollout.shrink_batch,
            shrink_min_rows=rollout.shrink_min_rows,
            eos_token_ids=eos_token_ids(self.tokenizer, self.model_config.eos_token_id))
        self.loss_config = LossConfig.from_config(config.loss, rollout.max_new_tokens)
        self.eval_sampling = held_out_sampling(config, self.sampling.eos_token_ids)
        offload = config.rollout.get("offload_weights_for_compile", "auto")
        self.offload_weights_for_compile = (jax.default_backend() == "gpu" if offload == "auto"
                                            else offload == "on")
        # (prompt shape, sampling config) -> executable
        self._sampler_programs: dict[tuple, jax.stages.Compiled] = {}
        self._sampler_compile_seconds = 0.0
        self.aqn_schedule = AQNSchedule(
            total_steps=config.train.total_steps, sigma_start=config.aqn.sigma_start,
            sigma_end=config.aqn.sigma_end, stages=config.aqn.stages,
            kind=config.aqn.schedule) if config.aqn.enabled else None
        self.step = 0
        self._state_at_boundary = True   # False while an update is being recorded
        self._signals = StopSignals()
        self.consecutive_nonfinite = 0
        self.skipped_updates = 0
        self.checkpoints = TrainingCheckpoints(os.path.join(workdir, "checkpoints"),
                                               config.checkpoint.max_to_keep)
        self.metrics = MetricsWriter.from_config(config, workdir, enabled=is_primary())
        self._compile_functions()
        self.start_step = 0
        if self.resume and not self.restore_newest():
            logger.info("no checkpoint in %s: the run starts at step 0",
                        self.checkpoints.directory)

    # -------------------------------------------------------------- jitted pieces
    def _compile_functions(self):
        programs = make_train_programs(
            self.graphdef, self.loss_config, self.optimizer,
            temperature=self.config.rollout.temperature,
            completion_length=self.config.rollout.max_new_tokens,
            logits_chunk_size=self.config.train.logits_chunk_size,
            state_shardings=(None if self.placement.mesh is None else (
                self.placement.shardings(self.trainable),
                self.placement.shardings(self.opt_state))))
        self._logprobs_fn, self._grad_fn = programs.logprobs, programs.accumulate_gradient
        self._zero_grads, self._scale = programs.zero_grads, programs.scale
        self._apply_update = programs.apply_update
        self._apply_update_copy = programs.apply_update_copy

    # -------------------------------------------------------------- rollout + rewards
    def _rollout_states(self):
        trainable, frozen = self.trainable, self.frozen
        if self.aqn_schedule is not None:
            trainable = aqn_noisy_state(trainable, self.aqn_key, self.step, self.aqn_schedule)
            frozen = aqn_noisy_state(frozen, self.aqn_key, self.step, self.aqn_schedule)
        return trainable, frozen

    def _sampler_program(self, prompt_shape: tuple[int, int], key,
                         sampling: SamplingConfig | None = None, states=None):
        """With rollout.offload_weights_for_compile: the sampler's executable for [P, T] prompts
        (`sampling`, default the rollouts'; `states`, a function returning the states it runs
        on, default _rollout_states), compiled on first use of their length bucket while the
        frozen weights are held in host memory (qerl_jax.infra.device_offload). Otherwise None:
        generate_from_states' jitted program, which compiles with the weights on the device.
        Same program, same numbers."""
        if not self.offload_weights_for_compile:
            return None
        sampling = self.sampling if sampling is None else sampling
        shape = padded_prompt_shape(prompt_shape, sampling)
        program_key = (shape, sampling)
        if program_key not in self._sampler_programs:
            started = time.perf_counter()
            abstract_states = self.placement.abstract(jax.eval_shape(
                states or self._rollout_states))
            try:   # the copies are made before any device buffer is freed
                host = offload_to_host(self.frozen,
                                       self.config.rollout.get("offload_method", "auto"))
            except MemoryError:
                host = None
                logger.warning("not enough host memory to hold the frozen weights while the "
                               "sampler compiles: compiling with them on the device (XLA's "
                               "autotuner may raise the peak)")
            try:
                self._sampler_programs[program_key] = compile_generate(
                    self.graphdef, abstract_states, shape, key, sampling,
                    mesh=self.placement.mesh)
            finally:
                if host is not None:
                    self.frozen = restore_to_device(host)
            seconds = time.perf_counter() - started
            self._sampler_compile_seconds += seconds
            logger.info("sampler program for prompts %s compiled in %.1f s with %.2f GiB of "
                        "frozen weights in host memory", shape, seconds,
                        0.0 if host is None else host.nbytes / 2**30)
        return self._sampler_programs[program_key]

    def _sample_groups(self, examples, attempt: int):
        texts = [build_prompt_text(self.tokenizer, example.question,
                                   style=self.config.data.prompt_style,
                                   use_chat_template=self.config.data.use_chat_template)
                 for example in examples]
        prompts = encode_prompts(self.tokenizer, texts, self.config.data.max_prompt_length)
        key = jax.random.fold_in(jax.random.fold_in(self.rollout_key, self.step), attempt)
        compiled = self._sampler_program(prompts.tokens.shape, key)
        rollout = to_host(generate_from_states(
            self.graphdef, self._rollout_states(), prompts.tokens, prompts.mask, key,
            self.sampling, compiled=compiled, mesh=self.placement.mesh))
        group = self.sampling.num_generations
        completions = decoded_completions(self.tokenizer, rollout)
        golds = [example.gold for example in examples for _ in range(group)]
        # each completion's scoring is bounded: one that takes longer scores 0 and is counted
        scores = score_completions(completions, golds, self.reward_functions,
                                   time_limit_seconds=self.config.rewards.time_limit_seconds)
        if self.correctness_key not in scores:
            scores[self.correctness_key] = score_completions(
                completions, golds, {self.correctness_name: self.correctness_function},
                time_limit_seconds=self.config.rewards.time_limit_seconds)[self.correctness_name]
        return prompts, rollout, scores

    def _group_entries(self, prompts, rollout, scores) -> list[dict]:
        """One entry per prompt: its tokens and mask, its G rollout rows and their scores."""
        group = self.sampling.num_generations
        entries = []
        for index in range(prompts.tokens.shape[0]):
            rows = slice(index * group, (index + 1) * group)
            entries.append({
                "prompt_tokens": prompts.tokens[index], "prompt_mask": prompts.mask[index],
                "rollout": jax.tree_util.tree_map(lambda a, rows=rows: a[rows], rollout),
                "scores": {name: values[rows] for name, values in scores.items()}})
        return entries

    def _collect_rollouts(self):
        """Rollout of P prompts (with dynamic sampling refills) -> training arrays + stats."""
        prompts_per_step = self.config.train.prompts_per_step
        started = time.perf_counter()
        groups: list[dict] = []
        dropped: list[dict] = []
        attempts = (self.config.train.dynamic_sampling_max_tries
                    if self.config.train.dynamic_sampling else 1)
        generated_tokens = 0
        for attempt in range(attempts):
            examples = self.iterator.next_batch()
            prompts, rollout, scores = self._sample_groups(examples, attempt)
            generated_tokens += int(rollout.lengths.sum())
            for entry in self._group_entries(prompts, rollout, scores):
                rewards = np.asarray(entry["scores"]["total"])
                degenerate = bool(np.all(rewards == rewards[0]))
                (dropped if self.config.train.dynamic_sampling and degenerate
                 else groups).append(entry)
            if len(groups) >= prompts_per_step:
                break
        groups = (groups + dropped)[:prompts_per_step]   # keep shapes static
        rollout_seconds = time.perf_counter() - started
        return self._training_arrays(groups), generated_tokens, rollout_seconds, len(dropped)

    def _training_arrays(self, groups: list[dict]):
        longest = max(len(group["prompt_tokens"]) for group in groups)
        return training_batch(
            groups, group_size=self.sampling.num_generations,
            prompt_length=bucket_length(longest, self.sampling.prompt_bucket),
            completion_length=self.sampling.max_new_tokens,
            mask_truncated=self.config.loss.mask_truncated_completions,
            advantage_estimator=self.config.loss.advantage_estimator)

    # -------------------------------------------------------------- held-out evaluation
    def evaluate(self) -> dict:
        """evaluation.held_out_metrics of the noise-free policy (quantized base + LoRA, no AQN
        noise): greedy (its key draws nothing), no training state changed."""
        def states():
            return self.trainable, self.frozen

        def sample(tokens, mask, key):
            # first: compiling with the weights offloaded replaces self.frozen's buffers
            compiled = self._sampler_program(tokens.shape, key, self.eval_sampling, states)
            return to_host(generate_from_states(self.graphdef, states(), tokens, mask, key,
                                                self.eval_sampling, compiled=compiled,
                                                mesh=self.placement.mesh))
        return held_out_metrics(sample, self.tokenizer, self.eval_examples, self.config,
                                self.correctness_function, self.step)

    # -------------------------------------------------------------- one step
    def _micro_batches(self, batch: dict):
        size = self.config.train.micro_batch_size
        rows = batch["tokens"].shape[0]
        for start in range(0, rows, size):
            yield {name: self.placement.rows(value[start:start + size])
                   for name, value in batch.items()}

    def train_step(self) -> dict:
        """One GRPO step, all or nothing: its metrics, with the trainer at the next step.

        An exception or interrupt before the update leaves the trainer exactly at the start of
        the step (data position included); the update and the state change that records it
        run with SIGINT/SIGTERM deferred, so the state is always that of a step boundary."""
        step, position = self.step, self.iterator.position
        try:
            return self._train_step()
        except BaseException:
            if self._state_at_boundary and self.step == step:   # the step did not complete
                self.iterator.epoch, self.iterator.index = position
            raise

    def _train_step(self) -> dict:
        config = self.config
        evaluation = self.evaluate() if evaluation_due(self.step, config) else {}
        self._sampler_compile_seconds = 0.0
        (batch, rewards, completion_mask, truncated), generated, rollout_seconds, dropped = (
            self._collect_rollouts())
        records = step_samples(   # K rows of the batch, decoded only when due
            self.step, batch, rewards, truncated, config.logging.samples, seed=config.seed,
            reward_names=list(self.reward_functions), correctness_key=self.correctness_key,
            decode_prompt=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            decode_completion=lambda ids: decode_completion(self.tokenizer, ids))
        started = time.perf_counter()
        frozen = self.frozen
        if self.aqn_schedule is not None and config.aqn.apply_in_training:
            frozen = aqn_noisy_state(frozen, self.aqn_key, self.step, self.aqn_schedule)
        if config.train.num_iterations > 1:
            batch["old_logprobs"] = np.concatenate([
                to_host(self._logprobs_fn(self.trainable, frozen, micro))
                for micro in self._micro_batches(batch)])
        if config.loss.beta != 0.0:
            batch["ref_logprobs"] = np.concatenate([
                to_host(self._logprobs_fn(self.reference_trainable, frozen, micro))
                for micro in self._micro_batches(batch)])
        global_tokens = np.float32(batch["loss_mask"].sum())   # host scalars: any mesh
        global_sequences = np.float32(batch["tokens"].shape[0])
        micro_count = math.ceil(batch["tokens"].shape[0] / config.train.micro_batch_size)
        stats = {"loss": 0.0, "valid_tokens": 0.0, "clipped_tokens": 0.0, "kl_sum": 0.0,
                 "entropy_sum": 0.0, "rollout_kl_sum": 0.0, "rollout_outside_sum": 0.0,
                 "rollout_corrected_tokens": 0.0, "rollout_corrected_sequences": 0.0,
                 "rollout_sequences": 0.0}
        iterations = config.train.num_iterations
        # Iterations before the last update a copy, so the step's starting state survives an
        # interrupt; the last one donates (one copy of the state) inside the deferred section.
        trainable, opt_state = self.trainable, self.opt_state
        norms, all_finite = [], True
        for iteration in range(iterations):
            grads = self._zero_grads(trainable)
            for micro in self._micro_batches(batch):
                (loss, (terms, sums)), grads = self._grad_fn(
                    trainable, frozen, micro, global_tokens, global_sequences, grads)
                if iteration == 0:
                    stats["loss"] += float(loss)
                    stats["valid_tokens"] += float(terms.valid_tokens)
                    stats["clipped_tokens"] += float(terms.clipped_tokens)
                    stats["kl_sum"] += float(terms.kl_sum)
                    for name, value in sums.items():
                        stats[name] += float(value)
            if not self.loss_config.denominator_is_global:
                grads = self._scale(grads, 1.0 / micro_count)   # bnpo: mean of micro ratios
                stats["loss"] = stats["loss"] / micro_count if iteration == 0 else stats["loss"]
            if iteration == iterations - 1:
                break
            update = self._apply_update_copy if iteration == 0 else self._apply_update
            trainable, opt_state, norm, finite = update(trainable, opt_state, grads)
            norms.append(float(norm))
            all_finite = all_finite and bool(finite)
        with self._signals.deferred():
            self._state_at_boundary = False
            # donates `trainable` (self.trainable when iterations == 1): from here the step
            # completes or the in-memory state is not saved
            self.trainable, self.opt_state, norm, finite = self._apply_update(
                trainable, opt_state, grads)
            del trainable, opt_state
            norms.append(float(norm))
            all_finite = all_finite and bool(finite)
            updated = all_finite and math.isfinite(stats["loss"])
            if updated:
                self.consecutive_nonfinite = 0
            else:
                self.consecutive_nonfinite += 1
                self.skipped_updates += 1
                logger.warning("step %d: non-finite loss or gradient, update skipped (%d in a "
                               "row)", self.step, self.consecutive_nonfinite)
            train_seconds = time.perf_counter() - started
            valid = max(stats["valid_tokens"], 1.0)

            def per_token(total):   # no valid token (every completion masked): no mean
                return total / valid if stats["valid_tokens"] > 0 else None
            metrics = {
                "step": self.step,
                "reward": float(np.mean(rewards["total"])),
                **{f"reward/{name}": float(np.mean(values)) for name, values in rewards.items()
                   if name in self.reward_functions},
                "reward/timeouts": int(np.sum(rewards.get("timeouts", [0.0]))),
                "accuracy": float(np.mean(np.asarray(rewards[self.correctness_key]) > 0)),
                "entropy": per_token(stats["entropy_sum"]),
                "kl": per_token(stats["kl_sum"]),
                "clip_fraction": per_token(stats["clipped_tokens"]),
                # the sampling policy (AQN noise, kernels) against the trained one, on the
                # sampled tokens: k3 KL(rollout || train) and the share of ratios off [1/2, 2]
                "rollout/kl": per_token(stats["rollout_kl_sum"]),
                "rollout/ratio_outside_2x": per_token(stats["rollout_outside_sum"]),
                # the shares of valid tokens and of sequences loss.rollout_correction changed
                "rollout/corrected_token_fraction": per_token(stats["rollout_corrected_tokens"]),
                "rollout/corrected_sequence_fraction": (
                    stats["rollout_corrected_sequences"] / stats["rollout_sequences"]
                    if stats["rollout_sequences"] > 0 else None),
                "loss": stats["loss"] if stats["valid_tokens"] > 0 else None,
                "completion_length": float(completion_mask.sum(axis=1).mean()),
                "truncated_fraction": float(truncated.mean()),
                "aqn_sigma": (float(aqn_sigma(self.step, self.aqn_schedule))
                              if self.aqn_schedule is not None else 0.0),
                "grad_norm": norms[-1],
                "learning_rate": float(self.lr_schedule(self.step)),
                "dropped_groups": dropped,
                "skipped_updates": self.skipped_updates,
                "time/rollout_s": rollout_seconds,
                "time/train_s": train_seconds,
                "time/sampler_compile_s": self._sampler_compile_seconds,   # part of rollout_s
                "rollout_tokens_per_s": generated / max(rollout_seconds, 1e-9),
                "peak_memory_bytes": peak_memory_bytes(),
                **evaluation,
            }
            self.metrics.write(metrics, records)
            self.step += 1
            self._state_at_boundary = True
        if self.consecutive_nonfinite >= config.train.max_consecutive_nonfinite:
            raise NonFiniteError(f"{self.consecutive_nonfinite} consecutive non-finite steps "
                                 f"(last at step {self.step - 1})")
        return metrics

    # -------------------------------------------------------------- checkpoints
    def _state_arrays(self):
        return {"trainable": self.trainable, "opt_state": self.opt_state}

    def save_checkpoint(self) -> None:
        """Checkpoint of the step boundary the trainer is at: the params and optimizer state
        after `step` completed steps, the data position and the counters (the RNG keys are
        functions of (seed, step), so the step is all the RNG state there is)."""
        meta = {"step": self.step, "data_position": list(self.iterator.position),
                "seed": self.config.seed, "skipped_updates": self.skipped_updates,
                "consecutive_nonfinite": self.consecutive_nonfinite}
        self.checkpoints.save(self.step, self._state_arrays(), meta)

    def restore_newest(self) -> bool:
        """Restores the newest checkpoint that restores (skipping damaged ones, each named in
        one warning); False when there is none."""
        try:
            restored = self.checkpoints.restore_newest(
                self._state_arrays(),
                check=lambda meta: check_resume_meta(meta, self.config.seed))
        except CheckpointMismatch as error:   # the config changed: not damage, nothing moved
            raise ConfigError(f"{error}; {changes_note(self._config_changes)}") from None
        if restored is None:
            return False
        arrays, meta, step = restored
        self.trainable, self.opt_state = commit_to_devices(
            (arrays["trainable"], arrays["opt_state"]))
        self.step = self.start_step = step
        self.iterator.epoch, self.iterator.index = meta["data_position"]
        self.skipped_updates = meta["skipped_updates"]
        self.consecutive_nonfinite = meta["consecutive_nonfinite"]
        logger.info("resuming from checkpoint %s (step %d)", self.checkpoints.step_path(step),
                    step)
        return True

    # -------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Runs until config.train.total_steps (or `stop_after` steps of this call),
        checkpointing every config.checkpoint.every_steps and at exit; with eval.every_steps,
        a run that reaches total_steps evaluates its final policy (a metrics row of its own,
        not in the returned history).

        SIGINT, SIGTERM or an exception stop the run at a step boundary: the last completed
        step is checkpointed (with its data position) and TrainingStopped (signals) or the
        exception propagates, after one log line saying where the run stopped."""
        self.metrics.start(self.step)
        if is_primary():
            record_start(self.workdir, {
                **run_metadata(self.config.to_json(), self.config.seed),
                "start_step": self.step, "resumed": self.resume,
                "config_changes": self._config_changes})
        self._config_changes = []
        total = self.config.train.total_steps
        last = total if stop_after is None else min(total, self.step + stop_after)
        history: list[dict] = []
        try:
            with self._signals.installed(), progress_bar(
                    self.config.logging.progress_bar, total, self.step) as progress:
                while self.step < last:
                    metrics = self.train_step()
                    history.append(metrics)
                    progress.show(metrics)
                    if self.step % self.config.checkpoint.every_steps == 0:
                        with self._signals.deferred():
                            self.save_checkpoint()
                if self.step == total and evaluation_due(self.step, self.config):
                    self.metrics.write({"step": self.step, **self.evaluate()})   # final policy
        except BaseException as error:   # the progress bar is closed: one log line below it
            stopped = self._stopped(error)
            if stopped is error:
                raise
            raise stopped from error
        try:
            if self.checkpoints.latest_step() != self.step and self.step > 0:
                self.save_checkpoint()
        finally:
            self.checkpoints.close()
            self.metrics.close()
        self._plot()
        return history

    def _stopped(self, error: BaseException) -> BaseException:
        """Saves the last completed step (when the in-memory state is one and not yet saved)
        and returns the exception to raise: TrainingStopped for a signal, else `error`."""
        note = ""
        if not isinstance(error, TrainingStopped) and self._state_at_boundary:
            try:
                if self.step > 0 and self.checkpoints.latest_step() != self.step:
                    self.save_checkpoint()
            except TrainingStopped as save_error:
                note = f" ({save_error})"
        latest = self.checkpoints.latest_step()
        saved = None if latest is None else self.checkpoints.step_path(latest)
        self.checkpoints.close()
        self.metrics.close()
        where = (f"checkpoint {saved} (step {latest}); continue with --resume" if saved
                 else "no checkpoint; a restart begins at step 0")
        if isinstance(error, Interrupted):
            return TrainingStopped(
                f"stopped by {error.signal_name} at step {self.step} of "
                f"{self.config.train.total_steps}: last completed step saved in {where}{note}",
                exit_code=128 + error.signum)
        if isinstance(error, TrainingStopped):   # the CLI prints it: one line
            return TrainingStopped(f"{error}; the run stopped at step {self.step}, resumes "
                                   f"from {where}", exit_code=error.exit_code)
        logger.error("stopped at step %d by %s: %s; resumes from %s%s", self.step,
                     type(error).__name__, error, where, note)
        return error

    def _plot(self) -> None:
        if is_primary() and os.path.isfile(self.metrics.path):
            write_run_curves(read_metrics(self.workdir), self.workdir, self._config_dict)

    def model(self) -> CausalLM:
        """The current (noise-free) model."""
        return nnx.merge(self.graphdef, self.trainable, self.frozen)
