import json, os, sys, time, glob, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks/profile")); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import rmsnorm_lora as rl
from decode_profile import device_events
M, H, L = 8, 3584, 28
out = {}
def xla_variant(x, sc, a):
    x32 = x.astype(jnp.float32)
    n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * sc).astype(jnp.bfloat16)
    return n, jnp.dot(n, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
def xla_reduce(x, sc, a):
    x32 = x.astype(jnp.float32)
    n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * sc).astype(jnp.bfloat16)
    return n, jnp.sum(n.astype(jnp.float32)[:, :, None] * a.astype(jnp.float32)[None], axis=1).astype(jnp.bfloat16)
def xla_f32dot(x, sc, a):
    x32 = x.astype(jnp.float32)
    n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * sc).astype(jnp.bfloat16)
    return n, jnp.dot(n.astype(jnp.float32), a.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)
def xla_t_reduce(x, sc, a):  # A^T layout [R, H]: a row reduction per output
    x32 = x.astype(jnp.float32)
    n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * sc).astype(jnp.bfloat16)
    at = a.T
    return n, jnp.sum(n.astype(jnp.float32)[:, None, :] * at.astype(jnp.float32)[None], axis=2).astype(jnp.bfloat16)
variants = {"xla": xla_variant, "xla_reduce": xla_reduce, "xla_f32dot": xla_f32dot}
configs = {"xla": None}
for bm, br, bh, nw, ns in [(16,16,512,4,2),(16,16,256,4,3),(16,32,256,4,2),(16,16,128,4,4),(16,8,512,4,2),(16,16,512,8,2)]:
    configs[f"dot_bm{bm}_br{br}_bh{bh}_w{nw}_s{ns}"] = rl.RMSNormLoRAConfig(block_m=bm, block_r=br, block_h=bh, num_warps=nw, num_stages=ns)
for R in (96, 64):
    k = jax.random.split(jax.random.key(R), 4)
    x0 = (jax.random.normal(k[0], (M, H)) * 3).astype(jnp.bfloat16)
    scs = 1 + 0.1 * jax.random.normal(k[1], (L, H), jnp.float32)
    As = tuple((0.05 * jax.random.normal(jax.random.fold_in(k[2], l), (H, R))).astype(jnp.bfloat16) for l in range(L))
    ref = None
    for name, cfg in configs.items():
        if cfg is not None and R % cfg.block_r: continue
        f = variants[name] if cfg is None else (lambda x, s, a, cfg=cfg: rl.rmsnorm_lora(x, s, a, eps=1e-6, config=cfg))
        def chain(x, scs, As):
            outs = []
            for l in range(L):
                n, xa = f(x, scs[l], As[l])
                outs.append(xa)
                x = n
            return x, jnp.stack(outs)
        fn = jax.jit(chain)
        res = jax.block_until_ready(fn(x0, scs, As))
        if ref is None: ref = res
        diff = [float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()) for a, b in zip(res, ref)]
        t = time.perf_counter(); n_rep = 200
        for _ in range(n_rep): res = fn(x0, scs, As)
        jax.block_until_ready(res); wall = (time.perf_counter() - t) / n_rep / L * 1e6
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        for _ in range(20): res = fn(x0, scs, As)
        jax.block_until_ready(res); jax.profiler.stop_trace()
        ev, _ = device_events(d)
        tot = {}
        for nm, us in ev: tot[nm] = tot.get(nm, 0) + us
        import re as _re
        kinds = {}
        for nm, v in tot.items():
            kind = _re.sub(r"[._]?\d+$", "", nm)
            kinds[kind] = kinds.get(kind, 0) + v
        per = {nm: v / (20 * L) for nm, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:6]}
        busy = sum(tot.values()) / (20 * L)
        out[f"R{R}_{name}"] = dict(wall_us_per_junction=wall, device_us_per_junction=busy, top=per, maxdiff_vs_xla=diff)
        print(f"R{R} {name:22s} wall {wall:6.2f} us  device {busy:6.2f} us  diff {diff}  {dict((k[:30], round(v,2)) for k,v in per.items())}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rl_probe.json"), "w"), indent=1)
