"""The rollout benchmark's peer: Hugging Face transformers `generate` on the device's torch, the
same model shape (random bf16 weights), prompt, batch and new-token count as benchmarks/rollout.py,
with the fast path transformers documents: a static KV cache and `torch.compile` of the forward
(mode "reduce-overhead", CUDA graphs). EOS off (every sequence runs to the limit), sampling at
temperature 1, no LoRA. One worker process per size; each batch is generated once to compile
(timed apart) and then `--repeats` times (tok/s = generated tokens / wall time of one call,
prefill included; the median over repeats).

With --lengths (benchmarks/rollout.py's option: the GRPO-sized case with measured completion
lengths) each row has the stop length rollout.py draws for it (same file, seed and batch):
generate runs every row to the longest one, as rollout.py's loop does, and tok/s counts each
row's tokens up to its length only. transformers' static-cache decode computes the finished
rows until then (its graph has a fixed batch); the tokens past a row's length are not counted.

    python benchmarks/transformers_peer.py --size 7b --batches 8 --results peer.jsonl
    python benchmarks/transformers_peer.py --size tiny --batches 2 --new-tokens 8 --prompt 16 \\
        --results /tmp/peer.jsonl             # CPU: eager (torch.compile only on CUDA)

benchmarks/rollout.py --peer runs it after its own workers, in the same call, and puts its rows
in the rollout table as format 'bf16 transformers'.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _harness as harness
import _models as models


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", required=True, help="7b, 14b, 32b or a preset name")
    parser.add_argument("--batches", required=True, help="comma list, run ascending")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="torch.compile the forward ('auto': on CUDA only)")
    parser.add_argument("--lengths", default="",
                        help="JSON of completion lengths, as rollout.py's --lengths")
    parser.add_argument("--results", required=True, help="rows appended here (jsonl)")
    args = parser.parse_args(argv)
    args.length_values = harness.parsed_lengths(parser, args.lengths)
    return args


def hf_model(size: str, seed: int, device: str):
    """A transformers causal LM of the preset's shape, random bf16 weights, on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qerl_jax.models.config import preset

    architecture = preset(models.preset_name(size), param_dtype="bfloat16",
                          compute_dtype="bfloat16")
    hf = architecture.to_hf_dict()
    config = AutoConfig.for_model(**hf)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return architecture, model.eval()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_compile = args.compile == "on" or (args.compile == "auto" and device == "cuda")
    base = {"size": args.size, "format": "bf16 transformers", "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                    + ("static cache + torch.compile" if use_compile else "static cache, eager")}
    started = time.perf_counter()
    architecture, model = hf_model(args.size, args.seed, device)
    base["init_s"] = time.perf_counter() - started
    model.generation_config.cache_implementation = "static"
    # generate compiles the decode forward itself with a static cache (CompileConfig, CUDA
    # graphs through mode="reduce-overhead"); wrapping model.forward in torch.compile as well
    # makes its graphs replay over outputs generate still reads (a RuntimeError on the GPU).
    if use_compile:
        model.generation_config.compile_config = transformers.CompileConfig(
            fullgraph=True, mode="reduce-overhead")
    else:
        model.generation_config.disable_compile = True
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for batch in sorted(int(b) for b in harness.split_list(args.batches)):
        row = {**base, "batch": batch}
        try:
            tokens = torch.randint(0, architecture.vocab_size, (batch, args.prompt),
                                   generator=generator, device=device)
            new_tokens, counted = args.new_tokens, batch * args.new_tokens
            if args.length_values is not None:
                stop = harness.draw_lengths(args.length_values, batch, args.new_tokens, args.seed)
                new_tokens, counted = int(stop.max()), int(stop.sum())
                row["mean_length"] = float(stop.mean())
            row["steps"] = new_tokens   # decode steps every row runs
            settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            attention_mask=torch.ones_like(tokens), pad_token_id=0)

            def timed():
                if device == "cuda":
                    torch.cuda.synchronize()
                begin = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(tokens, **settings)
                if device == "cuda":
                    torch.cuda.synchronize()
                # every row runs to new_tokens; with --lengths only its drawn length counts
                complete = int(out.shape[1] - args.prompt) == new_tokens
                return time.perf_counter() - begin, counted, complete

            row["compile_s"], _, _ = timed()   # first call: compiles and captures
            runs = [timed() for _ in range(args.repeats)]
            complete = all(run[2] for run in runs)
            runs = [run[:2] for run in runs]
            row["run_s"], generated = runs[0]
            row["generated_tokens"] = generated
            row["tokens_per_s"] = generated / row["run_s"]
            if args.repeats > 1:
                rates = [count / seconds for seconds, count in runs]
                row["tokens_per_s_runs"] = " / ".join(f"{rate:.0f}" for rate in rates)
                row["tokens_per_s_median"] = statistics.median(rates)
            row["status"] = ("ok" if complete
                             else f"ok, but generate stopped before {new_tokens} tokens")
            if device == "cuda":
                row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as error:  # recorded; the next batch still runs
            row["status"] = harness.describe_error(error)
        harness.append_jsonl(args.results, row)
        print({k: row.get(k) for k in ("size", "batch", "status", "compile_s", "tokens_per_s")},
              flush=True)


if __name__ == "__main__":
    main()
