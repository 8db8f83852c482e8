"""Where a decode step's time goes: a device trace of the sampler, kernels summed by name.

Builds the rollout benchmark's model (random weights, LoRA r32 unmerged, the kernels
config.quant.kernels describes), compiles
the sampler program with the benchmark's cache length (prompt + 2048 slots) but only
--steps decode steps, runs it once to warm up, times it, then runs it under jax.profiler and
reads the trace back (jax.profiler.ProfileData): every device event is summed by name, and the
table lists the kernels by total time per decode step (the one prefill is in the totals too; it
is small next to --steps decode steps, and its kernels are the ones with count 1).

    python benchmarks/profile/decode_profile.py --size 7b --format nvfp4 --batch 8 --out $OUT
    python benchmarks/profile/decode_profile.py --smoke --out /tmp/decode_profile   # CPU, seconds

With --short-cache the same is also run with a cache of prompt + steps slots, which shows what
attending over the full cache costs. Any other choice is a field of the trainer's config, set
with --config.FIELD=VALUE (e.g. --config.quant.kernels.mosaic_nvfp4=off,
--config.rollout.kv_cache_dtype=int8, --config.quant.kernels.enabled=false).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
import _models as models  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="7b")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--cache-new-tokens", type=int, default=2048,
                        help="cache slots after the prompt (the benchmark's completion length)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps traced")
    parser.add_argument("--rank", type=int, default=32,
                        help="LoRA rank: config.lora.rank, and config.lora.alpha = rank")
    parser.add_argument("--short-cache", action="store_true",
                        help="also profile with a cache of prompt + steps slots")
    parser.add_argument("--top", type=int, default=45, help="rows of the kernel table")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, seconds")
    parser.add_argument("--tile-k", type=int, default=None,
                        help="K tile of every weight's kernel layout (default: per weight)")
    parser.add_argument("--hlo-out", default=None,
                        help="also write the compiled program's optimized HLO (gzip text) here")
    parser.add_argument("--out", default=".")
    parser.epilog = harness.OVERRIDES_HELP
    args = harness.parse_arguments(parser, argv)
    if args.smoke:
        args.size, args.batch, args.prompt, args.cache_new_tokens, args.steps = "tiny", 2, 16, 16, 4
    base = models.rollout_config(
        preset=models.preset_name(args.size), format_name=args.format,
        tokenizer_dir=models.char_tokenizer_dir(os.path.join(os.path.abspath(args.out),
                                                             "tokenizer")),
        rank=args.rank, prompt=args.prompt, new_tokens=args.cache_new_tokens)
    args.config = models.configured(parser, base, args.overrides, {
        "model.preset": "--size", "quant.format": "--format", "lora.rank": "--rank",
        "rollout.prompt_bucket": "--prompt", "rollout.max_new_tokens": "--cache-new-tokens"})
    args.tag = models.config_tag(args.config, base)
    return args


def category(name: str) -> str:
    """A coarse label of a device event from its name (XLA fusion / library / Pallas names)."""
    lowered = name.lower()
    rules = [("memcpy", "memcpy"), ("memset", "memset"), ("nvfp4", "pallas fp4 matmul"),
             ("mxfp4", "pallas fp4 matmul"), ("nf4", "pallas nf4 matmul"),
             ("dequant", "pallas dequantize"), ("gemm", "dense gemm"), ("cublas", "dense gemm"),
             ("cutlass", "dense gemm"), ("sm90", "dense gemm"), ("dot", "dense gemm"),
             ("triton", "xla triton fusion"), ("dynamic_update_slice", "cache update"),
             ("dynamic-update-slice", "cache update"), ("reduce", "reduction fusion"),
             ("fusion", "elementwise fusion"), ("copy", "copy"), ("sort", "sort"),
             ("select", "elementwise fusion")]
    for marker, label in rules:
        if marker in lowered:
            return label
    return "other"


def device_events(trace_dir: str) -> tuple[list[tuple[str, float]], str]:
    """(list of (name, duration_us) of every device-side event, plane used). Reads the newest
    .xplane.pb under trace_dir; the device plane is '/device:GPU:0' (or the first non-host
    plane); on a CPU-only backend the host XLA thread events are returned instead."""
    from jax.profiler import ProfileData
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no .xplane.pb written under {trace_dir}")
    data = ProfileData.from_file(files[-1])
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    events: list[tuple[str, float]] = []
    if device:
        plane = device[0]
        lines = list(plane.lines)
        # kernel lines are the per-stream ones; skip XLA's summary lines ("XLA Modules",
        # "XLA Ops", "Steps"), which repeat the same time at a coarser grain
        stream_lines = [line for line in lines if line.name.lower().startswith("stream")]
        for line in stream_lines or lines:
            events += [(event.name, event.duration_ns / 1e3) for event in line.events]
        return events, plane.name + f" ({len(stream_lines)} stream lines)"
    for plane in planes:
        if plane.name == "/host:CPU":
            for line in plane.lines:
                if line.name != "python":
                    events += [(event.name, event.duration_ns / 1e3) for event in line.events]
    return events, "/host:CPU (no device plane)"


def summarize(events, steps: int, top: int) -> tuple[list[dict], dict]:
    totals: dict[str, list] = {}
    for name, duration in events:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
    rows = [{"kernel": name[:90], "category": category(name), "total_us": total,
             "count": count, "per_step_us": total / steps, "per_step_count": count / steps,
             "mean_us": total / count}
            for name, (total, count) in totals.items()]
    rows.sort(key=lambda row: -row["total_us"])
    by_category: dict[str, dict] = {}
    for row in rows:
        entry = by_category.setdefault(row["category"], {"per_step_us": 0.0,
                                                         "per_step_count": 0.0})
        entry["per_step_us"] += row["per_step_us"]
        entry["per_step_count"] += row["per_step_count"]
    return rows[:top], by_category


def profile_case(graphdef, states, architecture, args, cache_length: int, label: str,
                 out_dir: str) -> dict:
    import jax
    import jax.numpy as jnp

    from qerl_jax import sampling
    rollout = args.config.rollout
    config = sampling.SamplingConfig(max_new_tokens=args.steps, temperature=rollout.temperature,
                                     eos_token_ids=(), num_generations=1,
                                     prompt_bucket=args.prompt,
                                     kv_cache_dtype=rollout.kv_cache_dtype,
                                     dequantize_once=rollout.dequantize_once)
    key = jax.random.key(args.config.seed + 3)
    tokens = jax.random.randint(key, (args.batch, args.prompt), 0, architecture.vocab_size,
                                jnp.int32)
    mask = jnp.ones((args.batch, args.prompt), jnp.bool_)
    begin = time.perf_counter()
    compiled = sampling._generate_program.lower(graphdef, states, tokens, mask, key,
                                                config=config,
                                                cache_length=cache_length).compile()
    compile_s = time.perf_counter() - begin
    if args.hlo_out:
        import gzip
        os.makedirs(os.path.dirname(os.path.abspath(args.hlo_out)), exist_ok=True)
        with gzip.open(args.hlo_out, "wt") as handle:
            handle.write(compiled.as_text())
    jax.block_until_ready(compiled(states, tokens, mask, key))      # warm-up
    begin = time.perf_counter()
    jax.block_until_ready(compiled(states, tokens, mask, key))
    wall_s = time.perf_counter() - begin
    trace_dir = tempfile.mkdtemp(prefix=f"trace_{label}_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(compiled(states, tokens, mask, key))
    events, plane = device_events(trace_dir)
    top, by_category = summarize(events, args.steps, args.top)
    busy_us = sum(duration for _, duration in events)
    return {"label": label, "cache_length": cache_length, "compile_s": compile_s,
            "wall_s": wall_s, "wall_per_step_ms": 1e3 * wall_s / args.steps,
            "device_busy_per_step_ms": busy_us / 1e3 / args.steps,
            "events_per_step": len(events) / args.steps, "plane": plane,
            "top": top, "by_category": by_category}


def report(case: dict, args) -> str:
    lines = [f"### {case['label']}: cache {case['cache_length']} slots",
             "",
             f"- wall per decode step (whole program / {args.steps} steps, prefill included): "
             f"{case['wall_per_step_ms']:.3f} ms; compile {case['compile_s']:.1f} s",
             f"- device events summed per step: {case['device_busy_per_step_ms']:.3f} ms in "
             f"{case['events_per_step']:.0f} events ({case['plane']})",
             "", "| category | ms per step | events per step |", "|---|---|---|"]
    for name, entry in sorted(case["by_category"].items(), key=lambda kv: -kv[1]["per_step_us"]):
        lines.append(f"| {name} | {entry['per_step_us'] / 1e3:.3f} | "
                     f"{entry['per_step_count']:.1f} |")
    lines += ["", "| kernel | category | us per step | count per step | mean us |",
              "|---|---|---|---|---|"]
    for row in case["top"]:
        name = row["kernel"].replace("|", "/")
        lines.append(f"| `{name}` | {row['category']} | {row['per_step_us']:.1f} | "
                     f"{row['per_step_count']:.2f} | {row['mean_us']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import jax
    started = time.perf_counter()
    architecture, graphdef, states, info = models.build_sampling_model(args.config,
                                                                       tile_k=args.tile_k)
    init_s = time.perf_counter() - started
    cases = [profile_case(graphdef, states, architecture, args,
                          args.prompt + args.cache_new_tokens, "full cache", args.out)]
    if args.short_cache:
        cases.append(profile_case(graphdef, states, architecture, args,
                                  args.prompt + args.steps, "short cache", args.out))
    peak, _ = harness.peak_memory_gib()
    rows = [{"size": args.size, "format": args.format, "batch": args.batch, **info,
             **harness.device_info()}]
    header = harness.header_line(
        f"Decode-step profile: {args.size} {args.format}, batch {args.batch}, prompt "
        f"{args.prompt}, {args.steps} decode steps traced, KV cache "
        f"{args.config.rollout.kv_cache_dtype}, "
        f"LoRA r{args.rank} unmerged, kernel "
        f"hook: {info.get('kernel_hook')}; init {init_s:.0f} s, peak {peak:.1f} GiB", rows)
    text = "\n\n".join([header] + [report(case, args) for case in cases])
    print(text, flush=True)
    kv_cache = args.config.rollout.kv_cache_dtype
    name = f"decode_profile_{args.size}_{args.format}_b{args.batch}{args.tag}" + (
        f"_tile{args.tile_k}" if args.tile_k else "") + (
        f"_kv-{kv_cache}" if kv_cache != "auto" else "")
    harness.write_outputs(args.out, name, text, {"argv": sys.argv, "info": info,
                                                "init_s": init_s, "peak_GiB": peak,
                                                "cases": cases, "jax": jax.__version__})


if __name__ == "__main__":
    main()
