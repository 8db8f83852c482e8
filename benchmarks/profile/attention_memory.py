"""What XLA allocates for the training attention, per implementation and query blocks.

Compiles (never runs) the gradient of a mean-logit loss for a model with the attention shapes
of a preset (default: Qwen2.5-7B's heads, head_dim and T = prompt 256 + completion 1024) but few
layers and a small hidden / MLP / vocab, for each ModelConfig.attention_query_chunk asked with
the 'xla' attention and, with --implementations including cudnn, for cuDNN's fused attention
(ModelConfig.attention_implementation='cudnn', NVIDIA GPUs), and reports XLA's memory analysis
of the program (temporaries, the 'xla' attention's share of which grows as T^2 per layer).
Abstract inputs only: no weights are allocated, so it runs on a laptop CPU; on a GPU it shows
what that backend's compiler does.

--check (GPU, needs cudnn in --implementations) also runs a 2-layer model of those shapes with
random bf16 weights on a left-padded batch, through both implementations and through the 'xla'
attention in float32, and reports each bf16 implementation's error against the float32 one:
the loss, the logits of real tokens and the gradients (relative norm of the difference, per
parameter, the largest). cuDNN passes when its errors are at most twice the bf16 'xla' ones
(plus 1e-3 absolute slack).

    python benchmarks/profile/attention_memory.py --out $OUT                       # 7B heads, T = 1280
    python benchmarks/profile/attention_memory.py --chunks 0,128,256,512 --length 5120 --out $OUT
    python benchmarks/profile/attention_memory.py --implementations xla,cudnn --check --out $OUT  # GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
import _models as models  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="7b", help="preset whose attention heads are used")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences (the micro-batch)")
    parser.add_argument("--length", type=int, default=1280, help="tokens per sequence (T)")
    parser.add_argument("--chunks", default="0,256",
                        help="attention_query_chunk values of the 'xla' attention")
    parser.add_argument("--implementations", default="xla",
                        help="comma list of xla,cudnn (cudnn: NVIDIA GPUs, chunk 0 only)")
    parser.add_argument("--check", action="store_true",
                        help="run both implementations against a float32 reference (GPU)")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def _config(args, **fields):
    from qerl_jax.models.config import preset
    heads = preset(models.preset_name(args.size))
    settings = dict(hidden_size=heads.num_attention_heads * heads.resolved_head_dim,
                    head_dim=heads.resolved_head_dim, intermediate_size=512,
                    num_hidden_layers=args.layers, num_attention_heads=heads.num_attention_heads,
                    num_key_value_heads=heads.num_key_value_heads, vocab_size=512,
                    compute_dtype="bfloat16", param_dtype="bfloat16", remat=True)
    return preset("tiny_qwen2", **{**settings, **fields})


def measure(args, implementation: str, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qerl_jax.models.transformer import (init_model, set_attention_implementation,
                                             set_attention_query_chunk)
    config = heads = _config(args)
    model = nnx.eval_shape(lambda: init_model(config, 0))
    set_attention_implementation(model, implementation)
    set_attention_query_chunk(model, chunk)
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens)[..., 0])

    begin = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    analysis = compiled.memory_analysis()
    scores = (args.batch * heads.num_attention_heads * args.length
              * (min(chunk, args.length) if chunk else args.length) * 4)
    return {"implementation": implementation, "chunk": chunk, "layers": args.layers, "batch": args.batch, "length": args.length,
            "heads": f"{heads.num_attention_heads}/{heads.num_key_value_heads}",
            "temp_MiB": analysis.temp_size_in_bytes / 2 ** 20,
            "one_scores_MiB": scores / 2 ** 20 if implementation == "xla" else 0.0,
            "compile_s": time.perf_counter() - begin,
            **harness.device_info()}


def check(args) -> dict:
    """Runs the bf16 'xla' and 'cudnn' attentions and the float32 'xla' one on the same
    left-padded batch: each bf16 implementation's error against float32 (loss, real-token
    logits, gradients)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from qerl_jax.models.transformer import init_model, set_attention_implementation
    layers = min(args.layers, 2)
    args_small = argparse.Namespace(**{**vars(args), "layers": layers})
    reference = init_model(_config(args_small, param_dtype="float32", compute_dtype="float32"),
                           seed=1)
    _, state32 = nnx.split(reference)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 512, (args.batch, args.length)), jnp.int32)
    mask = np.ones((args.batch, args.length), bool)
    mask[-1, :args.length // 4] = False      # the last row left-padded by a quarter
    mask = jnp.asarray(mask)
    real = np.asarray(mask)

    def run(implementation, dtype):
        model = init_model(_config(args_small, param_dtype=dtype, compute_dtype=dtype), seed=1)
        graphdef, _ = nnx.split(model)
        state = jax.tree_util.tree_map(lambda leaf: leaf.astype(dtype), state32)
        model = nnx.merge(graphdef, state)
        set_attention_implementation(model, implementation)
        graphdef, state = nnx.split(model)

        def loss(state):
            logits = nnx.merge(graphdef, state)(tokens, attention_mask=mask)
            log_probs = jax.nn.log_softmax(logits)
            picked = jnp.take_along_axis(log_probs, tokens[..., None], -1)[..., 0]
            return -jnp.sum(picked * mask) / jnp.sum(mask), logits

        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return (float(value), np.asarray(logits, np.float32)[real],
                [np.asarray(leaf, np.float32) for leaf in jax.tree_util.tree_leaves(grads)])

    exact = run("xla", "float32")
    errors = {}
    for implementation in ("xla", "cudnn"):
        value, logits, grads = run(implementation, "bfloat16")
        grad_errors = [float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
                       for g, r in zip(grads, exact[2])]
        errors[implementation] = {"loss_abs_err": abs(value - exact[0]),
                                  "logits_max_abs_err": float(np.abs(logits - exact[1]).max()),
                                  "grad_max_rel_err": max(grad_errors)}
    ok = all(errors["cudnn"][name] <= 2 * errors["xla"][name] + 1e-3 for name in errors["xla"])
    return {"layers": layers, "batch": args.batch, "length": args.length,
            "float32_loss": exact[0], "errors": errors, "cudnn_within_2x_of_xla_bf16": ok,
            **harness.device_info()}


def main(argv=None):
    args = parse_args(argv)
    chunks = [int(value) for value in harness.split_list(args.chunks)]
    implementations = harness.split_list(args.implementations)
    if any(chunk < 0 for chunk in chunks) or args.length <= 0 or args.layers <= 0:
        raise SystemExit("--chunks must be >= 0, --length and --layers positive")
    unknown = sorted(set(implementations) - {"xla", "cudnn"})
    if unknown:
        raise SystemExit(f"--implementations: unknown {unknown} (xla, cudnn)")
    if args.check and "cudnn" not in implementations:
        raise SystemExit("--check compares cudnn with xla: add cudnn to --implementations")
    settings = ([("xla", chunk) for chunk in chunks] if "xla" in implementations else [])
    settings += [("cudnn", 0)] if "cudnn" in implementations else []
    rows = [measure(args, implementation, chunk) for implementation, chunk in settings]
    columns = [("implementation", "attention"), ("chunk", "attention_query_chunk"),
               ("layers", "layers"), ("batch", "batch"),
               ("length", "T"), ("heads", "heads q/kv"), ("one_scores_MiB",
                                                          "one float32 score block MiB"),
               ("temp_MiB", "XLA temporaries MiB"), ("compile_s", "compile s")]
    text = (harness.header_line(f"Training-attention memory (gradient program, compiled only), "
                               f"{args.size} heads", rows)
            + "\n\n" + harness.markdown_table(rows, columns))
    payload = {"rows": rows}
    if args.check:
        result = check(args)
        payload["check"] = result
        lines = [f"\n\nbf16 against float32 'xla' ({result['layers']} layers, batch "
                 f"{result['batch']}, T = {result['length']}, last row left-padded by T/4; "
                 f"float32 loss {result['float32_loss']:.6f}):\n",
                 "| attention | loss abs err | real-token logits max abs err | "
                 "gradient max relative err |", "|---|---|---|---|"]
        for name, error in result["errors"].items():
            lines.append(f"| {name} | {error['loss_abs_err']:.3g} | "
                         f"{error['logits_max_abs_err']:.3g} | {error['grad_max_rel_err']:.3g} |")
        lines.append(f"\ncuDNN within 2x of the bf16 'xla' errors: "
                     f"{result['cudnn_within_2x_of_xla_bf16']}")
        text += "\n".join(lines)
    print(text)
    harness.write_outputs(args.out, f"attention_memory_{args.size}", text, payload)


if __name__ == "__main__":
    main()
