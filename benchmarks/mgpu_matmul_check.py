"""GPU check and device time of the Mosaic GPU NVFP4 decode matmul (pallas_kernels.mgpu_nvfp4).

--check: y = x @ W^T / tensor_scale (+ scale * down @ B) for random NVFP4 checkpoints (the whole
e4m3 scale range, kernels.py's random_checkpoint) over M, LoRA ranks, split counts and shapes,
against a float64 numpy product of the checkpoint's weights (the E2M1 table x e4m3 scale /
tensor scale) and of the LoRA term with the kernel's bf16 roundings (bf16(scale x down) @
bf16(B)); the bound is 1e-5 x (|x| @ |W|^T + |lora x| @ |B|) per element (float32
accumulation over K <= 27648 of exact products).
--profile: device time per call (all device events of the call: the kernel and XLA's split-K
sum; profiler trace, weights streamed from HBM as in kernel_profile.py) of the Mosaic GPU
kernel and of the fused Triton kernel (bw.blockwise_matmul, default decode config), both with a
rank-32 LoRA, at the 32B shapes.

    python benchmarks/mgpu_matmul_check.py --check --profile --out $OUT      # GPU only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import _common as common
import kernel_profile

CHECK_CASES = [  # (n, k, m, rank, splits)
    (256, 1024, 8, 0, None), (256, 1024, 5, 32, 3), (200, 608, 1, 16, 1),
    (1024, 5120, 16, 32, None), (640, 2304, 64, 64, 2), (5120, 27648, 8, 32, None),
    (5120, 5120, 8, 32, 4), (384, 4096, 3, 0, 16)]
PROFILE_SHAPES = [("q/o", 5120, 5120), ("down", 5120, 27648), ("gate|up", 55296, 5120)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def _inputs(key, n, k, m, rank):
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    ckpt = kernel_bench.random_checkpoint("nvfp4", n, k, jax.random.fold_in(key, 1))
    x, down, lora_b = kernel_profile.layer_inputs(jax.random.fold_in(key, 2), m, n, k, rank)
    return ckpt, x, down, lora_b


def check_case(key, n, k, m, rank, splits):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul

    ckpt, x, down, lora_b = _inputs(key, n, k, m, rank)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    permuted = mg.permute_packed(packed)
    kwargs = dict(lora_down=down, lora_b=lora_b, lora_scale=2.0) if rank else {}
    fn = jax.jit(lambda x, p, ts, kw: mg.mgpu_nvfp4_matmul(x, p, ts, n=n, k=k, splits=splits,
                                                          **kw))
    y = np.asarray(fn(x, permuted, packed.tensor_scale, kwargs), np.float64)
    w = np.asarray(nvfp4_matmul.nvfp4_dequantize_reference(*ckpt), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref = x64 @ w.T
    bound = np.abs(x64) @ np.abs(w).T
    if rank:
        lx = np.asarray((down.astype(jnp.float32) * 2.0).astype(jnp.bfloat16)
                        .astype(jnp.float32), np.float64)
        b64 = np.asarray(lora_b.astype(jnp.float32), np.float64)
        ref, bound = ref + lx @ b64, bound + np.abs(lx) @ np.abs(b64)
    excess = np.abs(y - ref) / (1e-5 * bound + 1e-30)
    return {"n": n, "k": k, "m": m, "rank": rank, "splits": splits or "default",
            "max_err_over_bound": float(excess.max()), "finite": bool(np.isfinite(y).all()),
            "ok": bool(np.isfinite(y).all() and excess.max() <= 1.0)}


def profile_shape(key, name, n, k, m, repeats):
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
    triton = kernel_bench.copies(packed, count)
    config = bw.default_matmul_config(m, packed)
    fn = jax.jit(lambda x, ws, d, b: [bw.blockwise_matmul(
        x, w, spec=nvfp4_matmul.NVFP4, config=config, lora_down=d, lora_b=b, lora_scale=2.0)
        for w in ws])
    _, call_us, _ = kernel_profile.traced_device_us(fn, (x, triton, down, lora_b), repeats,
                                                    count, None)
    rows.append({"shape": name, "n": n, "k": k, "kernel": "Triton fused (LoRA r32)",
                 "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
    del triton
    permuted = [jax.block_until_ready(mg.permute_packed(w))
                for w in kernel_bench.copies(packed, count)]
    ts = packed.tensor_scale
    for splits in (None,):
        fn = jax.jit(lambda x, ps, d, b: [mg.mgpu_nvfp4_matmul(
            x, p, ts, n=n, k=k, splits=splits, lora_down=d, lora_b=b, lora_scale=2.0)
            for p in ps])
        _, call_us, _ = kernel_profile.traced_device_us(fn, (x, permuted, down, lora_b),
                                                        repeats, count, None)
        rows.append({"shape": name, "n": n, "k": k,
                     "kernel": f"Mosaic GPU permuted (LoRA r32), splits "
                               f"{splits or mg.default_splits(-(-n // 64), -(-k // 256))}",
                     "call_us": call_us, "TB_s": nbytes / call_us / 1e6})
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
                row = dict(zip(("n", "k", "m", "rank", "splits"), case), ok=False,
                           error=common.describe_error(e))
            checks.append(row)
            print(row, flush=True)
        passed = sum(r["ok"] for r in checks)
        sections.append(f"### Check: {passed} of {len(checks)} cases within the bound\n\n"
                        + common.markdown_table(checks, [
                            ("n", "N"), ("k", "K"), ("m", "M"), ("rank", "LoRA rank"),
                            ("splits", "splits"), ("max_err_over_bound", "max err / bound"),
                            ("finite", "finite"), ("ok", "ok"), ("error", "error")]))
    if args.profile:
        for name, n, k in PROFILE_SHAPES:
            try:
                profiles += profile_shape(key, name, n, k, args.m, args.repeats)
            except Exception as e:
                traceback.print_exc()
                profiles.append({"shape": name, "n": n, "k": k,
                                 "error": common.describe_error(e)})
            print(profiles[-1], flush=True)
        sections.append(f"### Device time per call, M = {args.m}\n\n" + common.markdown_table(
            profiles, [("shape", "shape"), ("n", "N"), ("k", "K"), ("kernel", "kernel"),
                       ("call_us", "us per call"), ("TB_s", "weight TB/s"),
                       ("error", "error")]))
    text = common.header_line(
        f"Mosaic GPU NVFP4 matmul, {time.perf_counter() - started:.0f} s", [meta]) + "\n\n" \
        + "\n\n".join(sections)
    print(text, flush=True)
    common.write_outputs(args.out, "mgpu_matmul_check", text,
                         {"argv": sys.argv, "checks": checks, "profiles": profiles, **meta})
    if args.check and not all(r["ok"] for r in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
