"""Times Hugging Face transformers' `generate` on a model directory: the rollout peer of
`flashgrpo bench-rollout`, which runs this script in the same process tree and prints both.

Sampling as TRL's GRPOTrainer configures it on a CPU without vLLM (`do_sample=True`, the given
temperature, `top_k=0`, `top_p=1.0`, KV cache), on the prompts `flashgrpo bench-rollout` wrote
(token ids, left-padded here as TRL pads them). Every row generates exactly `--max-new-tokens`
tokens (`min_new_tokens` keeps end-of-sequence from stopping a row early), so both tools
produce the same number of tokens. One JSON line: tokens, seconds per call (median and all),
tokens/s, peak RSS.

Usage: hf_generate.py --model DIR --prompts FILE.json --max-new-tokens N [--repeats R]
"""

import argparse
import json
import resource
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "f32", "bf16"],
                    help="torch's names or flashgrpo's (model.dtype)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with open(args.prompts) as f:
        prompts = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, {"f32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype)))
    model.eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else pad
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    config = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p if args.min_p > 0 else None,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
        disable_compile=True,
    )

    def one_call():
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        seconds = time.perf_counter() - start
        return seconds, (out.shape[1] - longest) * out.shape[0]

    for _ in range(args.warmup):
        one_call()
    times, tokens = [], 0
    for _ in range(args.repeats):
        seconds, tokens = one_call()
        times.append(seconds)
    p50 = statistics.median(times)
    print(
        json.dumps(
            {
                "impl": "transformers.generate",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "batch": len(prompts),
                "prompt_len_max": longest,
                "tokens": tokens,
                "seconds_p50": p50,
                "seconds": times,
                "tokens_per_s": tokens / p50,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
