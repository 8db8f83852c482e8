"""GPU check and device time of the Mosaic GPU NVFP4 decode matmul (pallas_kernels.mgpu_nvfp4).

--check: y = x @ W^T / tensor_scale (+ scale * down @ B) for random NVFP4 checkpoints (the whole
e4m3 scale range, kernels.py's random_checkpoint) over M, LoRA ranks, split counts and shapes,
against a float64 numpy product of the checkpoint's weights (the E2M1 table x e4m3 scale /
tensor scale) and of the LoRA term with the kernel's bf16 roundings (bf16(down) @ its LoRA
operand, mgpu_nvfp4.lora_operand, rescaled by 2^8 / tensor scale; that operand's scale folding
is checked against float64 on the CPU, tests/test_mgpu_nvfp4.py); the bound is 1e-5 x
(|x| @ |W|^T + the same product of absolute values) per element (float32 accumulation over
K <= 27648 of exact products). Cases marked "prepared" pass the operand made ahead (lora_bt,
as the sampler does), the others pass B and the LoRA scale. Some split counts do not divide
the K tiles (the kernel skips a program's surplus last step). Grouped cases: three weights
stacked as the dispatch's grouped q|k|v launch (check_group_case).
--profile: device time per call (all device events of the call: the kernel and XLA's split-K
sum and rescale; profiler trace, weights streamed from HBM as in kernel_profile.py) of the Mosaic GPU
kernel (LoRA operand made ahead, as in the sampler) and of the fused Triton kernel
(bw.blockwise_matmul, default decode config), both with a rank-32 LoRA, at the decode launch
shapes of --sizes (q/o, down, the gate|up pair as one weight, and q|k|v: Triton's grouped
launch against the kernel on the three weights stacked with a block-diagonal rank-96 operand);
with --sweep also other split-K counts (sweep_splits), with --stages other pipeline depths
(default 2). With 32b, the fused SwiGLU launch of a 32B
gate/up pair with the next layer's LoRA product (swiglu_rows): the Mosaic path checked against
Triton's fused kernel (within 2^-7 of the largest output) and both timed.
--sampler PRESET: the sampler end to end (common.build_sampling_model: random NVFP4 weights,
rank-32 LoRA with nonzero B, the kernel hook) without and with QERL_MOSAIC_NVFP4=1 (the same
model rebuilt from the same seed; the o and down projections' decode launches, the grouped
q|k|v launches and the gate/up pairs' fused SwiGLU launches then take this kernel, with their
LoRA operands made once per rollout), and on the XLA path (no kernels) as the noise floor: batch 8, prompt 64, 64 sampled tokens at temperature 1 from the same key. Reported
per pair of paths: the common token prefix of each row and the largest |log-prob difference|
on it. A random model's next-token distribution is nearly uniform over 151k ids, so summation
order alone moves some draws (Triton vs XLA shows how much); ok when the Mosaic path's gap to
the others is at most max(0.05, twice the Triton-XLA gap).

    python benchmarks/profile/mgpu_matmul_check.py --check --profile --sampler qwen2p5_1p5b \
        --out $OUT      # GPU only
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
import _common as common  # noqa: E402
import kernel_profile  # noqa: E402

CHECK_CASES = [  # (n, k, m, rank, splits, LoRA operand prepared)
    (256, 1024, 8, 0, None, False), (256, 1024, 5, 32, 3, False), (200, 608, 1, 16, 1, True),
    (1024, 5120, 16, 32, None, False), (640, 2304, 64, 64, 2, True),
    (5120, 27648, 8, 32, None, True), (5120, 5120, 8, 32, 4, False),
    (384, 4096, 3, 0, 16, False),
    # splits that do not divide the K tiles (7 K tiles in 3; 7B's down: 74 in 9), 14B's down
    # (LoRA operand made in the call) and gate|up pair shapes
    (384, 1792, 8, 32, 3, True), (3584, 18944, 8, 32, None, True),
    (5120, 13824, 8, 32, None, False), (27648, 5120, 5, 16, None, True)]
GROUP_CHECK_CASES = [  # (member Ns, k, m, rank of each, splits): grouped q|k|v launches
    ((5120, 1024, 1024), 5120, 8, 32, None), ((256, 128, 128), 1792, 5, 16, 3),
    ((3584, 512, 512), 3584, 8, 64, None)]


def profile_shapes(size: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of a model size's decode launches: q/o, down, the gate|up pair (one
    [2 I, H] weight) and q|k|v (grouped: [H + 2 kv, H])."""
    from qerl_jax.models import config as model_config
    arch = getattr(model_config, common.preset_name(size))()
    h, i = arch.hidden_size, arch.intermediate_size
    kv = arch.num_key_value_heads * arch.resolved_head_dim
    return [("q/o", h, h), ("down", h, i), ("gate|up", 2 * i, h), ("q|k|v", h + 2 * kv, h)]


def schedules(n: int, k: int, sweep: bool, stages=(2,)) -> list[tuple[str, dict]]:
    """(label, matmul keyword arguments) of the schedules --profile times: the default split-K
    count, and with --sweep half and twice it; each at every pipeline depth in `stages`
    (--stages; 2, the kernel's default, unlabelled)."""
    from pallas_kernels import mgpu_nvfp4 as mg
    splits = mg.default_splits(-(-n // 64), -(-k // 256))
    out = [(f"splits {splits}", {})]
    if sweep:
        out += [(f"splits {s}", {"splits": s}) for s in sweep_splits(n, k)]
    return [(label if depth == 2 else f"{label}, stages {depth}",
             kwargs if depth == 2 else {**kwargs, "stages": depth})
            for depth in stages for label, kwargs in out]


def sweep_splits(n: int, k: int) -> list[int]:
    """--sweep: half and twice the default split count, where that makes one to two waves of
    programs (132-1056; uneven counts included)."""
    from pallas_kernels import mgpu_nvfp4 as mg
    row_tiles, k_tiles = -(-n // 64), -(-k // 256)
    default = mg.default_splits(row_tiles, k_tiles)
    return [s for s in (default // 2, 2 * default)
            if s and s != default and s <= k_tiles and 132 <= row_tiles * s <= 1056]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sampler", default=None, metavar="PRESET")
    parser.add_argument("--sweep", action="store_true",
                        help="--profile also times other split-K counts (sweep_splits)")
    parser.add_argument("--mosaic-only", action="store_true",
                        help="--profile times the Mosaic GPU kernel only (no Triton rows)")
    parser.add_argument("--stages", default="2",
                        help="comma-separated pipeline depths --profile times (default 2)")
    parser.add_argument("--sizes", default="32b",
                        help="comma-separated model sizes whose launch shapes --profile times")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def _inputs(key, n, k, m, rank):
    import jax
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    ckpt = kernel_bench.random_checkpoint("nvfp4", n, k, jax.random.fold_in(key, 1))
    x, down, lora_b = kernel_profile.layer_inputs(jax.random.fold_in(key, 2), m, n, k, rank)
    return ckpt, x, down, lora_b


def check_case(key, n, k, m, rank, splits, prepared):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul

    ckpt, x, down, lora_b = _inputs(key, n, k, m, rank)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    permuted = mg.permute_packed(packed)
    operand = None
    kwargs = {}
    if rank:
        operand = mg.lora_operand(lora_b, packed.tensor_scale, 2.0,
                                  n_pad=packed.codes.shape[0])
        kwargs = dict(lora_down=down, lora_bt=operand) if prepared else dict(
            lora_down=down, lora_b=lora_b, lora_scale=2.0)
    fn = jax.jit(lambda x, p, ts, kw: mg.mgpu_nvfp4_matmul(x, p, ts, n=n, k=k, splits=splits,
                                                          **kw))
    y = np.asarray(fn(x, permuted, packed.tensor_scale, kwargs), np.float64)
    w = np.asarray(nvfp4_matmul.nvfp4_dequantize_reference(*ckpt), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref = x64 @ w.T
    bound = np.abs(x64) @ np.abs(w).T
    if rank:
        lx = np.asarray(down.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        bt = np.asarray(operand.astype(jnp.float32), np.float64)[:n]
        rescale = 2.0 ** -mg.SCALED_EXPONENT / float(np.asarray(packed.tensor_scale).reshape(()))
        ref = ref + (lx @ bt.T) * rescale
        bound = bound + (np.abs(lx) @ np.abs(bt).T) * rescale
    excess = np.abs(y - ref) / (1e-5 * bound + 1e-30)
    return {"n": n, "k": k, "m": m, "rank": rank, "splits": splits or "default",
            "prepared": prepared,
            "max_err_over_bound": float(excess.max()), "finite": bool(np.isfinite(y).all()),
            "ok": bool(np.isfinite(y).all() and excess.max() <= 1.0)}


def check_group_case(key, ns, k, m, rank, splits):
    """A grouped q|k|v launch as the dispatch runs it (kernel_dispatch._mosaic_group_forward's
    arithmetic): the members' permuted buffers stacked (group_permuted), the block-diagonal
    operand (group_lora_operand), one kernel call, each member's columns rescaled by its own
    2^8 / tensor_scale; each member against its float64 product as check_case's bound."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul

    members = [_inputs(jax.random.fold_in(key, i), n, k, m, rank) for i, n in enumerate(ns)]
    x = members[0][1]
    down = jnp.concatenate([member[2] for member in members], axis=1)
    packed = [nvfp4_matmul.repack_nvfp4(*member[0]) for member in members]
    tiles = mg.group_permuted([mg.permute_packed(p) for p in packed], [k] * len(ns))
    n_pads = [p.codes.shape[0] for p in packed]
    operand = mg.group_lora_operand([member[3] for member in members],
                                    [p.tensor_scale for p in packed], [2.0] * len(ns), n_pads)
    fn = jax.jit(lambda x, t, d, o: mg.matmul_unscaled(x, t, n=sum(n_pads), k=k,
                                                       splits=splits, lora_down=d, lora_bt=o))
    y = np.asarray(fn(x, tiles, down, operand), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    lx = np.asarray(down.astype(jnp.float32), np.float64)
    bt_all = np.asarray(operand.astype(jnp.float32), np.float64)
    worst, finite, offset = 0.0, bool(np.isfinite(y).all()), 0
    for n, member, p, n_pad in zip(ns, members, packed, n_pads):
        rescale = 2.0 ** -mg.SCALED_EXPONENT / float(np.asarray(p.tensor_scale).reshape(()))
        got = y[:, offset:offset + n] * rescale
        w = np.asarray(nvfp4_matmul.nvfp4_dequantize_reference(*member[0]), np.float64)
        bt = bt_all[offset:offset + n]
        ref = x64 @ w.T + (lx @ bt.T) * rescale
        bound = np.abs(x64) @ np.abs(w).T + (np.abs(lx) @ np.abs(bt).T) * rescale
        worst = max(worst, float((np.abs(got - ref) / (1e-5 * bound + 1e-30)).max()))
        offset += n_pad
    return {"n": "+".join(map(str, ns)), "k": k, "m": m, "rank": f"3 x {rank}",
            "splits": splits or "default", "prepared": True, "max_err_over_bound": worst,
            "finite": finite, "ok": finite and worst <= 1.0}


def group_profile_rows(key, name, n, k, m, repeats, sweep, ns, stages=(2,), triton=True):
    """q|k|v: Triton's grouped launch (three weights, r32 each; unless not triton) against the
    Mosaic kernel on the stacked buffer with the block-diagonal rank-96 operand (+ XLA's
    per-member rescale)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench

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
        weights = kernel_bench.copies(list(packed), count)
        fn = jax.jit(lambda x, groups, d: [bw.blockwise_matmul_group(
            x, tuple(g), spec=nvfp4_matmul.NVFP4, config=config, lora_down=d, lora_bs=lora_bs,
            lora_scales=(2.0,) * 3) for g in groups])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down), repeats, count,
                                                        None)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "Triton grouped (LoRA 3 x r32)",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
        del weights
    n_pads = [p.codes.shape[0] for p in packed]
    tiles = [jax.block_until_ready(mg.group_permuted([mg.permute_packed(w) for w in group],
                                                     [k] * 3))
             for group in kernel_bench.copies(list(packed), count)]
    operand = mg.group_lora_operand(lora_bs, [p.tensor_scale for p in packed], [2.0] * 3,
                                    n_pads)
    scales = [2.0 ** -mg.SCALED_EXPONENT / p.tensor_scale.reshape(()) for p in packed]
    for label, kwargs in schedules(sum(n_pads), k, sweep, stages):
        def launch(x, t, d, kwargs=kwargs):
            y = mg.matmul_unscaled(x, t, n=sum(n_pads), k=k, lora_down=d, lora_bt=operand,
                                   **kwargs)
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


def profile_shape(key, name, n, k, m, repeats, sweep=False, stages=(2,), triton=True):
    import jax
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench

    ckpt, x, down, lora_b = _inputs(key, n, k, m, 32)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    nbytes = kernel_profile.weight_bytes("nvfp4", n, k)
    count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
    rows = []
    if triton:
        weights = kernel_bench.copies(packed, count)
        config = bw.default_matmul_config(m, packed)
        fn = jax.jit(lambda x, ws, d, b: [bw.blockwise_matmul(
            x, w, spec=nvfp4_matmul.NVFP4, config=config, lora_down=d, lora_b=b,
            lora_scale=2.0) for w in ws])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down, lora_b), repeats,
                                                        count, None)
        rows.append({"shape": name, "n": n, "k": k, "kernel": "Triton fused (LoRA r32)",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
        del weights
    permuted = [jax.block_until_ready(mg.permute_packed(w))
                for w in kernel_bench.copies(packed, count)]
    ts = packed.tensor_scale
    operand = mg.lora_operand(lora_b, ts, 2.0, n_pad=packed.codes.shape[0])
    for label, kwargs in schedules(n, k, sweep, stages):
        fn = jax.jit(lambda x, ps, d, bt, kwargs=kwargs: [mg.mgpu_nvfp4_matmul(
            x, p, ts, n=n, k=k, lora_down=d, lora_bt=bt, **kwargs) for p in ps])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, permuted, down, operand),
                                                        repeats, count, None)
        rows.append({"shape": name, "n": n, "k": k,
                     "kernel": f"Mosaic GPU permuted (LoRA r32), {label}",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
        print(rows[-1], flush=True)
    return rows


def swiglu_rows(key, m: int, repeats: int, profile: bool) -> list[dict]:
    """The fused SwiGLU launch of a 32B gate/up pair with the next layer's LoRA product
    (kernel_dispatch._fused_forward_swiglu, as the sampler calls it, LoRA operands made ahead):
    Triton's fused kernel against the Mosaic GPU path: the kernel with the SwiGLU and each row
    tile's share of the next-LoRA product in its epilogue (mgpu_nvfp4.SwigluEpilogue, the
    default), and the kernel + XLA's SwiGLU and next-LoRA product. Check: equal within 2^-7
    of the largest |output| (bf16 outputs summed in different orders); with profile, device
    time per call (all events, weights from HBM)."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    from pallas_kernels import mgpu_nvfp4 as mg
    from qerl_jax.quant import kernel_dispatch as kd
    from qerl_jax.quant.nvfp4 import nvfp4_quantize

    n, k, rank = 27648, 5120, 32
    keys = jax.random.split(jax.random.fold_in(key, 7), 8)
    gate, up = (kd.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k)) * 0.02),
                                    tile_k=256) for i in (0, 1))
    views = kd.pair_gate_up(gate, up)
    del gate, up
    tiles = mg.permute_packed(kd._whole_pair(views[0]))
    views = tuple(kd._replace_children(v, mosaic_tiles=tiles) for v in views)
    x = jax.random.normal(keys[2], (m, k), jnp.bfloat16)
    down = (jax.random.normal(keys[3], (m, 2 * rank)) * 0.1).astype(jnp.bfloat16)
    lora_bs = tuple((jax.random.normal(keys[i], (rank, n)) * 0.01).astype(jnp.bfloat16)
                    for i in (4, 5))
    next_a = (jax.random.normal(keys[6], (n, rank)) * 0.01).astype(jnp.bfloat16)
    pair_b = kd._pair_lora_b(views, lora_bs)
    saved = kd._MOSAIC_NVFP4["single"]
    try:
        kd._MOSAIC_NVFP4["single"] = True
        prepared = (kd.with_mosaic_pair_lora_operand(*views, *lora_bs, 1.0), views[1])

        def make(flag, fused=True):
            kd._MOSAIC_NVFP4["single"] = flag  # read when the function is traced
            kd._MOSAIC_NVFP4["swiglu_epilogue"] = fused
            fn = jax.jit(lambda x, vs, d: [kd._fused_forward_swiglu(
                x, v, d, lora_bs, (1.0, 1.0), pair_b, compute_dtype=jnp.bfloat16,
                interpret=False, next_lora_a=next_a) for v in vs])
            jax.block_until_ready(fn(x, [prepared], down))  # traced now, with this flag
            return fn

        triton, mosaic, mosaic_xla = make(False), make(True), make(True, fused=False)
        (want, want_next), = triton(x, [prepared], down)
        rows = []
        for label, fn in (("fused epilogue", mosaic), ("XLA epilogue", mosaic_xla)):
            (got, got_next), = fn(x, [prepared], down)
            errors = [float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                            / (2.0 ** -7 * float(jnp.abs(b.astype(jnp.float32)).max())))
                      for a, b in ((got, want), (got_next, want_next))]
            rows.append({"shape": "gate|up SwiGLU + next LoRA", "n": n, "k": k,
                         "kernel": f"check: Mosaic ({label}) vs Triton, max err / (2^-7 "
                                   "max|y|), output / next",
                         "call_us": f"{errors[0]:.3g} / {errors[1]:.3g}",
                         "ok": bool(max(errors) <= 1.0)})
            print(rows[-1], flush=True)
        if profile:
            nbytes = 2 * kernel_profile.weight_bytes("nvfp4", n, k)
            count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
            weights = kernel_bench.copies(list(prepared), count)
            for name, fn in (("Triton fused SwiGLU (LoRA r32, next LoRA)", triton),
                             ("Mosaic GPU permuted, SwiGLU / next LoRA in its epilogue", mosaic),
                             ("Mosaic GPU permuted + XLA SwiGLU / next LoRA", mosaic_xla)):
                _, call_us, _ = kernel_profile.traced_device_us(fn, (x, weights, down), repeats,
                                                                count, None)
                rows.append({"shape": "gate|up SwiGLU + next LoRA", "n": n, "k": k,
                             "kernel": name, "call_us": call_us,
                             "TB_s": nbytes / call_us / 1e6})
                print(rows[-1], flush=True)
    finally:
        kd._MOSAIC_NVFP4["single"] = saved
        kd._MOSAIC_NVFP4["swiglu_epilogue"] = True
    return rows


def _agreement(a, b) -> tuple[np.ndarray, float]:
    """(common token prefix per row, max |log-prob difference| on those prefixes)."""
    (ta, la), (tb, lb) = a, b
    differs = np.asarray(ta) != np.asarray(tb)
    prefix = np.where(differs.any(1), differs.argmax(1), differs.shape[1])
    gap = max(float(np.abs(np.asarray(la)[i, :p] - np.asarray(lb)[i, :p]).max(initial=0.0))
              for i, p in enumerate(prefix))
    return prefix, gap


def sampler_agreement(preset: str) -> list[dict]:
    """Rollouts of one random model on the XLA path (no kernels), the Triton kernels and the
    Mosaic dispatch (see --sampler); one row per compared pair."""
    import jax
    import jax.numpy as jnp
    from qerl_jax import sampling

    config = sampling.SamplingConfig(max_new_tokens=64, temperature=1.0, eos_token_ids=(),
                                     num_generations=1, prompt_bucket=64)
    rollouts = {}
    for name, kernels, flag in (("XLA", False, "0"), ("Triton", True, "0"),
                                ("Mosaic", True, "1")):
        os.environ["QERL_MOSAIC_NVFP4"] = flag
        architecture, graphdef, states, _ = common.build_sampling_model(
            preset, "nvfp4", seed=0, use_kernels=kernels)
        tokens = jax.random.randint(jax.random.key(7), (8, 64), 0, architecture.vocab_size,
                                    jnp.int32)
        rollout = sampling.generate_from_states(graphdef, states, tokens,
                                                jnp.ones((8, 64), jnp.bool_),
                                                jax.random.key(8), config)
        rollouts[name] = jax.device_get((rollout.tokens, rollout.logprobs))
        del states
    os.environ["QERL_MOSAIC_NVFP4"] = "0"
    rows = []
    for a, b in (("Triton", "XLA"), ("Mosaic", "Triton"), ("Mosaic", "XLA")):
        prefix, gap = _agreement(rollouts[a], rollouts[b])
        rows.append({"preset": preset, "pair": f"{a} vs {b}",
                     "common_prefix": " ".join(map(str, prefix)), "max_logprob_gap": gap})
    floor = rows[0]["max_logprob_gap"]
    for row in rows[1:]:
        row["ok"] = bool(row["max_logprob_gap"] <= max(0.05, 2 * floor))
    rows[0]["ok"] = True
    return rows


def main(argv=None):
    args = parse_args(argv)
    import jax
    key = jax.random.key(0)
    started = time.perf_counter()
    sections = []
    meta = {**common.device_info(), "jax": jax.__version__}
    checks, profiles = [], []
    if args.check:
        for case in CHECK_CASES:
            try:
                row = check_case(key, *case)
            except Exception as e:
                traceback.print_exc()
                row = dict(zip(("n", "k", "m", "rank", "splits", "prepared"), case), ok=False,
                           error=common.describe_error(e))
            checks.append(row)
            print(row, flush=True)
        for case in GROUP_CHECK_CASES:
            try:
                row = check_group_case(key, *case)
            except Exception as e:
                traceback.print_exc()
                row = {"n": "+".join(map(str, case[0])), "k": case[1], "m": case[2],
                       "rank": f"3 x {case[3]}", "splits": case[4] or "default", "ok": False,
                       "error": common.describe_error(e)}
            checks.append(row)
            print(row, flush=True)
        passed = sum(r["ok"] for r in checks)
        sections.append(f"### Check: {passed} of {len(checks)} cases within the bound\n\n"
                        + common.markdown_table(checks, [
                            ("n", "N"), ("k", "K"), ("m", "M"), ("rank", "LoRA rank"),
                            ("splits", "splits"), ("prepared", "operand made ahead"),
                            ("max_err_over_bound", "max err / bound"),
                            ("finite", "finite"), ("ok", "ok"), ("error", "error")]))
    sampler = None
    if args.sampler:
        try:
            sampler = sampler_agreement(args.sampler)
        except Exception as e:
            traceback.print_exc()
            sampler = [{"preset": args.sampler, "ok": False,
                        "error": common.describe_error(e)}]
        print(sampler, flush=True)
        sections.append("### Sampler on the XLA path, the Triton kernels and with "
                        "QERL_MOSAIC_NVFP4=1\n\n"
                        + common.markdown_table(sampler, [
                            ("preset", "preset"), ("pair", "compared"),
                            ("common_prefix", "common token prefix per row"),
                            ("max_logprob_gap", "max |log-prob gap| on it"), ("ok", "ok"),
                            ("error", "error")]))
    if args.profile:
        stages = tuple(int(depth) for depth in args.stages.split(","))
        for size in args.sizes.split(","):
            for name, n, k in profile_shapes(size):
                label = f"{size} {name}"
                try:
                    if name == "q|k|v":
                        h = k
                        kv = (n - h) // 2
                        profiles += group_profile_rows(key, label, n, k, args.m, args.repeats,
                                                       args.sweep, (h, kv, kv), stages,
                                                       triton=not args.mosaic_only)
                    else:
                        profiles += profile_shape(key, label, n, k, args.m, args.repeats,
                                                  args.sweep, stages,
                                                  triton=not args.mosaic_only)
                except Exception as e:
                    traceback.print_exc()
                    profiles.append({"shape": label, "n": n, "k": k,
                                     "error": common.describe_error(e)})
                    print(profiles[-1], flush=True)
        if "32b" in args.sizes.split(","):
            try:
                profiles += swiglu_rows(key, args.m, args.repeats, profile=True)
            except Exception as e:
                traceback.print_exc()
                profiles.append({"shape": "gate|up SwiGLU + next LoRA", "ok": False,
                                 "error": common.describe_error(e)})
            print(profiles[-1], flush=True)
        sections.append(f"### Device time per call, M = {args.m}\n\n" + common.markdown_table(
            profiles, [("shape", "shape"), ("n", "N"), ("k", "K"), ("kernel", "kernel"),
                       ("call_us", "us per call"), ("TB_s", "weight TB/s"), ("ok", "ok"),
                       ("error", "error")]))
    text = common.header_line(
        f"Mosaic GPU NVFP4 matmul, {time.perf_counter() - started:.0f} s", [meta]) + "\n\n" \
        + "\n\n".join(sections)
    print(text, flush=True)
    common.write_outputs(args.out, "mgpu_matmul_check", text,
                         {"argv": sys.argv, "checks": checks, "profiles": profiles,
                          "sampler": sampler, **meta})
    if (args.check and not all(r["ok"] for r in checks)) or (
            sampler and not all(r["ok"] for r in sampler)) or not all(
            r.get("ok", True) for r in profiles):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
