"""Device time per call of the Mosaic GPU NVFP4 decode matmul (pallas_kernels.mgpu_nvfp4)
against the Triton fused kernel, at a model's decode launch shapes (GPU only).

All device events of the call (the kernel and XLA's split-K sum and rescale), from a profiler
trace, weights streamed from HBM as in kernel_profile.py; M = --m, LoRA rank 32. Shapes of each
size in --sizes: q/o, down, the gate|up pair as one weight, and q|k|v (Triton's grouped launch
against the Mosaic kernel on the three weights stacked with a block-diagonal rank-96 operand).
--sweep also times half and twice the default split-K count, --stages other pipeline depths
(default 2), --mosaic-only skips the Triton rows. Then for each size the fused SwiGLU launch
of its gate/up pair as the sampler makes it (LoRA r32 on each half: a 64-wide operand; the
next layer's LoRA product), on the Mosaic path at each --schedules entry with the SwiGLU in the
kernel's epilogue and in XLA (KernelOptions.mosaic_swiglu_epilogue_max_m), against Triton's
fused kernel (unless --mosaic-only): compared (within 2^-7 of the largest output) and timed.
The kernel's correctness checks are tests (tests/pallas_kernels/test_mgpu_nvfp4_gpu.py,
pytest -m gpu).

    python benchmarks/profile/mosaic_kernel_profile.py --profile --sizes 14b,32b --out $OUT
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import numpy as np

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
import _models as models  # noqa: E402
import kernel_profile  # noqa: E402

def profile_shapes(size: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of a model size's decode launches: q/o, down, the gate|up pair (one
    [2 I, H] weight) and q|k|v (grouped: [H + 2 kv, H])."""
    from qerl_jax.models import config as model_config
    arch = getattr(model_config, models.preset_name(size))()
    h, i = arch.hidden_size, arch.intermediate_size
    kv = arch.num_key_value_heads * arch.resolved_head_dim
    return [("q/o", h, h), ("down", h, i), ("gate|up", 2 * i, h), ("q|k|v", h + 2 * kv, h)]


def schedules(n: int, k: int, sweep: bool, stages=(None,), m: int = 8,
              extra_splits=(), kernel_schedules=("auto",),
              rank: int | None = 32) -> list[tuple[str, dict]]:
    """(label, matmul keyword arguments) of the schedules --profile times at M = m: for each
    kernel schedule of --schedules (mgpu_nvfp4.launch_schedule; "auto" unlabelled) the default
    split-K count, with --sweep half and twice it, and the counts of --splits; each at every
    pipeline depth in `stages` (--stages; the schedule's default, None, unlabelled). rank: the
    launch's LoRA operand width (the schedule "auto" picks depends on it)."""
    from pallas_kernels import mgpu_nvfp4_tuning as tuning
    row_tiles, k_tiles = -(-n // 64), -(-k // 256)
    out = []
    for schedule in kernel_schedules:
        tuned = tuning.TuningConfig(schedule=schedule)
        resolved = tuning.launch_schedule(m, row_tiles, rank=rank, config=tuned)
        splits = tuning.launch_splits(row_tiles, k_tiles, m=m, rank=rank, config=tuned)
        prefix = f"{resolved}, " if schedule != "auto" or len(kernel_schedules) > 1 else ""
        base = {} if schedule == "auto" else {"schedule": schedule}
        out.append((f"{prefix}splits {splits}", base))
        others = sweep_splits(n, k, m) if sweep else []
        others += [s for s in extra_splits if s not in others and 1 <= s <= k_tiles]
        out += [(f"{prefix}splits {s}", {**base, "splits": s}) for s in others if s != splits]
    return [(label if depth is None else f"{label}, stages {depth}",
             kwargs if depth is None else {**kwargs, "stages": depth})
            for depth in stages for label, kwargs in out]


def sweep_splits(n: int, k: int, m: int = 8) -> list[int]:
    """--sweep: half and twice the default split count at M = m, where that makes one to two
    waves of programs (132-1056; uneven counts included)."""
    from pallas_kernels import mgpu_nvfp4_tuning as tuning
    row_tiles, k_tiles = -(-n // 64), -(-k // 256)
    default = tuning.default_splits(row_tiles, k_tiles, device=tuning.device_facts(), m=m)
    return [s for s in (default // 2, 2 * default)
            if s and s != default and s <= k_tiles and 132 <= row_tiles * s <= 1056]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="time the launches (the default)")
    parser.add_argument("--sweep", action="store_true",
                        help="--profile also times other split-K counts (sweep_splits)")
    parser.add_argument("--mosaic-only", action="store_true",
                        help="--profile times the Mosaic GPU kernel only (no Triton rows)")
    parser.add_argument("--stages", default="",
                        help="comma-separated pipeline depths --profile times (default: each "
                             "schedule's own)")
    parser.add_argument("--schedules", default="auto",
                        help="comma-separated kernel schedules --profile times: auto, split_k, "
                             "warp_specialized (mgpu_nvfp4.launch_schedule)")
    parser.add_argument("--sizes", default="32b",
                        help="comma-separated model sizes whose launch shapes --profile times")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--splits", default="",
                        help="comma-separated split-K counts --profile also times (the Mosaic "
                             "rows; counts above a shape's K tiles are left out)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def _inputs(key, n, k, m, rank):
    import jax
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _kernel_cases as kernel_cases
    ckpt = kernel_cases.random_checkpoint("nvfp4", n, k, jax.random.fold_in(key, 1))
    x, down, lora_b = kernel_profile.layer_inputs(jax.random.fold_in(key, 2), m, n, k, rank)
    return ckpt, x, down, lora_b


def group_profile_rows(key, name, n, k, m, repeats, sweep, ns, stages=(None,), triton=True,
                       extra_splits=(), kernel_schedules=("auto",)):
    """q|k|v: Triton's grouped launch (three weights, r32 each; unless not triton) against the
    Mosaic kernel on the stacked buffer with the block-diagonal rank-96 operand (+ XLA's
    per-member rescale)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import mgpu_nvfp4_layout as layout
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _kernel_cases as kernel_cases

    members = [_inputs(jax.random.fold_in(key, i), ni, k, m, 32) for i, ni in enumerate(ns)]
    x = members[0][1]
    down = jnp.concatenate([member[2] for member in members], axis=1)
    lora_bs = tuple(member[3] for member in members)
    packed = tuple(nvfp4_matmul.repack_nvfp4(*member[0]) for member in members)
    nbytes = sum(kernel_profile.weight_bytes("nvfp4", ni, k) for ni in ns)
    count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
    config = bw.default_group_matmul_config(m, packed)
    rows = []
    if triton:
        weights = kernel_cases.copies(list(packed), count)
        fn = jax.jit(lambda x, groups, d: [bw.blockwise_matmul_group(
            x, tuple(g), spec=nvfp4_matmul.NVFP4, config=config, lora_x_a=d, lora_bs=lora_bs,
            lora_scales=(2.0,) * 3) for g in groups])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down), repeats, count,
                                                        None)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "Triton grouped (LoRA 3 x r32)",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
        del weights
    n_pads = [p.codes.shape[0] for p in packed]
    tiles = [jax.block_until_ready(layout.group_permuted(
                 [layout.permute_packed(w) for w in group], [k] * 3))
             for group in kernel_cases.copies(list(packed), count)]
    operand = layout.group_lora_operand(lora_bs, [p.tensor_scale for p in packed],
                                        [2.0] * 3, n_pads)
    scales = [2.0 ** -layout.SCALED_EXPONENT / p.tensor_scale.reshape(()) for p in packed]
    for label, kwargs in schedules(sum(n_pads), k, sweep, stages, m, extra_splits,
                                   kernel_schedules, rank=32 * len(ns)):
        def launch(x, t, d, kwargs=kwargs):
            y = mg.matmul_unscaled(x, t, n=sum(n_pads), k=k, lora_x_a=d, lora_bt=operand,
                                   config=mg.TuningConfig(**kwargs))
            bounds = np.cumsum([0] + n_pads)
            return [(y[:, a:a + ni] * s).astype(jnp.bfloat16)
                    for a, ni, s in zip(bounds, ns, scales)]
        fn = jax.jit(lambda x, ts, d: [launch(x, t, d) for t in ts])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, tiles, down), repeats, count,
                                                        None)
        rows.append({"shape": name, "n": n, "k": k,
                     "kernel": f"Mosaic GPU grouped (LoRA 3 x r32), {label}",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
    return rows


def profile_shape(key, name, n, k, m, repeats, sweep=False, stages=(None,), triton=True,
                  extra_splits=(), kernel_schedules=("auto",)):
    import jax
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import mgpu_nvfp4_layout as layout
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _kernel_cases as kernel_cases

    ckpt, x, down, lora_b = _inputs(key, n, k, m, 32)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    nbytes = kernel_profile.weight_bytes("nvfp4", n, k)
    count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
    rows = []
    if triton:
        weights = kernel_cases.copies(packed, count)
        config = bw.default_matmul_config(m, packed)
        fn = jax.jit(lambda x, ws, d, b: [bw.blockwise_matmul(
            x, w, spec=nvfp4_matmul.NVFP4, config=config, lora_x_a=d, lora_b=b,
            lora_scale=2.0) for w in ws])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down, lora_b), repeats,
                                                        count, None)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "Triton fused (LoRA r32)",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
        del weights
    permuted = [jax.block_until_ready(layout.permute_packed(w))
                for w in kernel_cases.copies(packed, count)]
    ts = packed.tensor_scale
    operand = layout.lora_operand(lora_b, ts, 2.0, n_pad=packed.codes.shape[0])
    for label, kwargs in schedules(n, k, sweep, stages, m, extra_splits, kernel_schedules):
        fn = jax.jit(lambda x, ps, d, bt, kwargs=kwargs: [mg.mgpu_nvfp4_matmul(
            x, p, ts, n=n, k=k, lora_x_a=d, lora_bt=bt, config=mg.TuningConfig(**kwargs))
            for p in ps])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, permuted, down, operand),
                                                        repeats, count, None)
        rows.append({"shape": name, "n": n, "k": k,
                     "kernel": f"Mosaic GPU permuted (LoRA r32), {label}",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
    return rows


def swiglu_rows(key, size: str, m: int, repeats: int, profile: bool, triton: bool = True,
                kernel_schedules=("auto",)) -> list[dict]:
    """The fused SwiGLU launch of a model size's gate/up pair with the next layer's LoRA
    product (the backends' apply_swiglu, as the sampler calls them, LoRA operands made
    ahead): the Mosaic GPU path at each kernel schedule, with the SwiGLU and each row tile's
    share of the next-LoRA product in the kernel's epilogue (mgpu_nvfp4.SwigluEpilogue) and
    with both in XLA, against Triton's fused kernel. Check: equal within 2^-7 of the largest
    |output| (bf16 outputs summed in different orders; against the first Mosaic launch with
    triton=False); with profile, device time per call (all events, weights from HBM)."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _kernel_cases as kernel_cases
    from pallas_kernels import mgpu_nvfp4_layout as layout
    from pallas_kernels import mgpu_nvfp4_tuning as tuning
    from qerl_jax.quant.backends import kernel_layout, mosaic
    from qerl_jax.quant.backends.triton import TritonDecodeBackend
    from qerl_jax.quant.kernel_options import KernelOptions
    from qerl_jax.quant.nvfp4 import nvfp4_quantize

    (_, pair_n, k), = [shape for shape in profile_shapes(size) if shape[0] == "gate|up"]
    n, rank, shape = pair_n // 2, 32, f"{size} gate|up SwiGLU + next LoRA"
    keys = jax.random.split(jax.random.fold_in(key, 7), 8)
    gate, up = (kernel_layout.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k)) * 0.02),
                                    tile_k=256) for i in (0, 1))
    views = kernel_layout.pair_gate_up(gate, up)
    del gate, up
    tiles = layout.permute_packed(views[0].whole_pair())
    views = tuple(mosaic.MosaicWeight.from_kernel_layout(v, mosaic_tiles=tiles) for v in views)
    x = jax.random.normal(keys[2], (m, k), jnp.bfloat16)
    down = (jax.random.normal(keys[3], (m, 2 * rank)) * 0.1).astype(jnp.bfloat16)
    lora_bs = tuple((jax.random.normal(keys[i], (rank, n)) * 0.01).astype(jnp.bfloat16)
                    for i in (4, 5))
    next_a = (jax.random.normal(keys[6], (n, rank)) * 0.01).astype(jnp.bfloat16)
    pair_b = TritonDecodeBackend("nvfp4", KernelOptions()).swiglu_lora_b(views, lora_bs)
    prepared = (views[0].with_pair_lora_operand(views[1], *lora_bs, 1.0), views[1])

    def make(**options):
        backend = (TritonDecodeBackend("nvfp4", KernelOptions(**options))
                   if options["mosaic_nvfp4"] == "off" else mosaic.MosaicBackend(KernelOptions(**options)))
        fn = jax.jit(lambda x, vs, d: [backend.apply_swiglu(
            x, v, d, lora_bs, (1.0, 1.0), pair_b, next_a, compute_dtype=jnp.bfloat16)
            for v in vs])
        jax.block_until_ready(fn(x, [prepared], down))
        return fn

    row_tiles = -(-pair_n // layout.TILE_ROWS)
    launches = []
    if triton:
        launches.append(("Triton fused SwiGLU (LoRA r32, next LoRA)", make(mosaic_nvfp4="off")))
    for schedule in kernel_schedules:
        resolved = tuning.launch_schedule(m, row_tiles, rank=2 * rank,
                                          config=tuning.TuningConfig(schedule=schedule))
        for where, max_m in (("its epilogue", 64), ("XLA", 0)):
            launches.append((f"Mosaic GPU permuted, SwiGLU / next LoRA in {where}, "
                             f"{schedule} ({resolved})",
                             make(mosaic_nvfp4="on", mosaic_schedule=schedule,
                                  mosaic_swiglu_epilogue_max_m=max_m)))
    (want, want_next), = launches[0][1](x, [prepared], down)
    rows = []
    for name, fn in launches[1:]:
        (got, got_next), = fn(x, [prepared], down)
        errors = [float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                        / (2.0 ** -7 * float(jnp.abs(b.astype(jnp.float32)).max())))
                  for a, b in ((got, want), (got_next, want_next))]
        rows.append({"shape": shape, "n": pair_n, "k": k,
                     "kernel": f"check: {name} vs {launches[0][0]}, max err / (2^-7 "
                               "max|y|), output / next",
                     "call_us": f"{errors[0]:.3g} / {errors[1]:.3g}",
                     "ok": bool(max(errors) <= 1.0)})
        print(rows[-1], flush=True)
    if profile:
        nbytes = 2 * kernel_profile.weight_bytes("nvfp4", n, k)
        count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
        weights = kernel_cases.copies(list(prepared), count)
        for name, fn in launches:
            _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down), repeats,
                                                            count, None)
            rows.append({"shape": shape, "n": pair_n, "k": k, "kernel": name,
                         "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    import jax
    key = jax.random.key(0)
    started = time.perf_counter()
    meta = {**harness.device_info(), "jax": jax.__version__}
    stages = tuple(int(depth) for depth in args.stages.split(",") if depth) or (None,)
    kernel_schedules = tuple(name for name in args.schedules.split(",") if name)
    extra_splits = tuple(int(count) for count in args.splits.split(",") if count)
    profiles = []
    for size in args.sizes.split(","):
        for name, n, k in profile_shapes(size):
            label = f"{size} {name}"
            try:
                if name == "q|k|v":
                    h = k
                    kv = (n - h) // 2
                    profiles += group_profile_rows(key, label, n, k, args.m, args.repeats,
                                                   args.sweep, (h, kv, kv), stages,
                                                   triton=not args.mosaic_only,
                                                   extra_splits=extra_splits,
                                                   kernel_schedules=kernel_schedules)
                else:
                    profiles += profile_shape(key, label, n, k, args.m, args.repeats,
                                              args.sweep, stages, triton=not args.mosaic_only,
                                              extra_splits=extra_splits,
                                              kernel_schedules=kernel_schedules)
            except Exception as e:
                traceback.print_exc()
                profiles.append({"shape": label, "n": n, "k": k,
                                 "error": harness.describe_error(e)})
                print(profiles[-1], flush=True)
    for size in args.sizes.split(","):
        try:
            profiles += swiglu_rows(key, size, args.m, args.repeats, profile=True,
                                    triton=not args.mosaic_only,
                                    kernel_schedules=kernel_schedules)
        except Exception as e:
            traceback.print_exc()
            profiles.append({"shape": f"{size} gate|up SwiGLU + next LoRA", "ok": False,
                             "error": harness.describe_error(e)})
            print(profiles[-1], flush=True)
    table = harness.markdown_table(profiles, [
        ("shape", "shape"), ("n", "N"), ("k", "K"), ("kernel", "kernel"),
        ("call_us", "us per call"), ("TB_s", "weight TB/s"), ("ok", "ok"), ("error", "error")])
    text = (harness.header_line(f"Mosaic GPU NVFP4 matmul, device time per call, M = {args.m}, "
                               f"{time.perf_counter() - started:.0f} s", [meta])
            + "\n\n" + table)
    print(text, flush=True)
    harness.write_outputs(args.out, "mosaic_kernel_profile", text,
                         {"argv": sys.argv, "profiles": profiles, **meta})
    if not all(r.get("ok", True) for r in profiles):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
