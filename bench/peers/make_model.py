"""A Qwen2.5-0.5B-shaped model with random weights, made by transformers from its config (Hugging
Face's Qwen/Qwen2.5-0.5B config.json, written out here: no network needed) and saved with
`save_pretrained`, for the rollout and trainer benchmarks. `--layers N` keeps the first N of its
24 layers (the width, heads, MLP and 151,936-row vocabulary are the real model's).

Usage: make_model.py --out DIR [--layers 24] [--seed 0]
"""

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151643,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=24,
    initializer_range=0.02,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": args.layers, "max_window_layers": args.layers})
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: Qwen2.5-0.5B shape, {args.layers} layers, {n / 1e6:.0f}M parameters, random weights")


if __name__ == "__main__":
    main()
