"""What XLA allocates for the training attention, with and without query blocks.

Compiles (never runs) the gradient of a mean-logit loss for a model with the attention shapes
of a preset (default: Qwen2.5-7B's heads, head_dim and T = prompt 256 + completion 1024) but few
layers and a small hidden / MLP / vocab, for each ModelConfig.attention_query_chunk asked, and
reports XLA's memory analysis of the program (temporaries, the attention's share of which
grows as T^2 per layer). Abstract inputs only: no weights are allocated, so it runs on a laptop
CPU; on a GPU it shows what that backend's compiler does.

    python benchmarks/attention_memory.py --out $OUT                       # 7B heads, T = 1280
    python benchmarks/attention_memory.py --chunks 0,128,256,512 --length 5120 --out $OUT
"""

from __future__ import annotations

import argparse
import time

import _common as common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="7b", help="preset whose attention heads are used")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences (the micro-batch)")
    parser.add_argument("--length", type=int, default=1280, help="tokens per sequence (T)")
    parser.add_argument("--chunks", default="0,256", help="attention_query_chunk values")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def measure(args, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qerl_jax.models.config import preset
    from qerl_jax.models.transformer import init_model, set_attention_query_chunk
    heads = preset(common.preset_name(args.size))
    config = preset("tiny_qwen2", hidden_size=heads.num_attention_heads * heads.resolved_head_dim,
                    head_dim=heads.resolved_head_dim, intermediate_size=512,
                    num_hidden_layers=args.layers, num_attention_heads=heads.num_attention_heads,
                    num_key_value_heads=heads.num_key_value_heads, vocab_size=512,
                    compute_dtype="bfloat16", param_dtype="bfloat16", remat=True)
    model = nnx.eval_shape(lambda: init_model(config, 0))
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
    return {"chunk": chunk, "layers": args.layers, "batch": args.batch, "length": args.length,
            "heads": f"{heads.num_attention_heads}/{heads.num_key_value_heads}",
            "temp_MiB": analysis.temp_size_in_bytes / 2 ** 20,
            "one_scores_MiB": scores / 2 ** 20, "compile_s": time.perf_counter() - begin,
            **common.device_info()}


def main(argv=None):
    args = parse_args(argv)
    chunks = [int(value) for value in common.split_list(args.chunks)]
    if any(chunk < 0 for chunk in chunks) or args.length <= 0 or args.layers <= 0:
        raise SystemExit("--chunks must be >= 0, --length and --layers positive")
    rows = [measure(args, chunk) for chunk in chunks]
    columns = [("chunk", "attention_query_chunk"), ("layers", "layers"), ("batch", "batch"),
               ("length", "T"), ("heads", "heads q/kv"), ("one_scores_MiB",
                                                          "one float32 score block MiB"),
               ("temp_MiB", "XLA temporaries MiB"), ("compile_s", "compile s")]
    text = (common.header_line(f"Training-attention memory (gradient program, compiled only), "
                               f"{args.size} heads", rows)
            + "\n\n" + common.markdown_table(rows, columns))
    print(text)
    common.write_outputs(args.out, f"attention_memory_{args.size}", text, {"rows": rows})


if __name__ == "__main__":
    main()
