"""`flashgrpo forward` against Hugging Face transformers on random Qwen2 configurations.

tests/peers/hf_forward.py checks one configuration; this draws many: head counts from MHA to
MQA, an explicit `head_dim` unlike hidden/heads, odd widths and vocabularies, 1-3 layers, RoPE
theta 1e4-1e6, both norms' epsilons, tied or not, checkpoints saved in f32 or bf16, sequences of
1-48 tokens with right, left or both-sided padding. Weights are drawn wider than HF's
initialiser so that logits spread over several units (the easy case is near-uniform logits).

f32: our logits and last hidden states against HF's f32 forward of the same weights, on real
tokens, within 1e-4 of the largest magnitude. `--dtype bf16` runs also ours in bf16 and checks
that its error against HF-f32 is within 3x of HF's own bf16 forward's error (+1e-3): a bf16 run
is as good as PyTorch's bf16, not bitwise equal to it.

Usage: python hf_forward_fuzz.py --bin target/release/flashgrpo [--seed 1] [--cases 40] [--bf16]
"""

import argparse
import logging
import os
import random
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def draw_config(rng):
    kv = rng.choice([1, 1, 2, 3, 4])
    heads = kv * rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([4, 8, 12, 16, 32, 64])
    explicit = rng.random() < 0.3
    hidden = heads * head_dim if not explicit else rng.choice([24, 40, 64, 96, 130])
    cfg = dict(vocab_size=rng.choice([2, 17, 151, 257, 1000, 1531]), hidden_size=hidden,
               intermediate_size=rng.choice([8, 33, 96, 200, 352]), num_hidden_layers=rng.choice([1, 2, 3]),
               num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
               tie_word_embeddings=rng.random() < 0.5, rope_theta=rng.choice([1e4, 1e5, 1e6]),
               rms_norm_eps=rng.choice([1e-6, 1e-5]))
    if explicit:
        cfg["head_dim"] = head_dim
    return cfg


def draw_inputs(rng, vocab):
    b, t = rng.randint(1, 4), rng.randint(1, 48)
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    mask = torch.ones(b, t, dtype=torch.int64)
    for row in range(b):
        left = rng.randint(0, t - 1) if rng.random() < 0.4 else 0
        right = rng.randint(0, t - 1 - left) if rng.random() < 0.4 else 0
        mask[row, :left] = 0
        mask[row, t - right:] = 0
    return ids, mask


def make_model(cfg, seed, scale):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(scale)
    return model


def run_ours(binary, model_dir, ids, mask, dtype, tmp):
    inp, out = os.path.join(tmp, "ids.safetensors"), os.path.join(tmp, "out.safetensors")
    save_file({"input_ids": ids} | ({"attention_mask": mask} if mask is not None else {}), inp)
    r = subprocess.run([binary, "forward", "--model", model_dir, "--inputs", inp, "--out", out, "--dtype", dtype],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip()[-2000:])
    return load_file(out)


def hf_outputs(model, ids, mask):
    with torch.no_grad():
        o = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return {"logits": o.logits.float(), "hidden_states": o.hidden_states[-1].float()}


def one_case(args, rng, case_no, tmp):
    cfg = draw_config(rng)
    checkpoint_bf16 = rng.random() < 0.3
    model = make_model(cfg, rng.randrange(2**31), scale=rng.choice([1.0, 3.0, 6.0]))
    ids, mask = draw_inputs(rng, cfg["vocab_size"])
    use_mask = not bool(mask.all()) or rng.random() < 0.5
    desc = (f"#{case_no} {cfg} ckpt={'bf16' if checkpoint_bf16 else 'f32'} ids={tuple(ids.shape)} "
            f"mask={'none' if not use_mask else mask.sum(1).tolist()}")
    model_dir = os.path.join(tmp, f"m{case_no}")
    (model.to(torch.bfloat16) if checkpoint_bf16 else model).save_pretrained(model_dir)
    # HF's models as a user gets them: `from_pretrained` keeps RoPE's `inv_freq` in f32 whatever
    # the weights' dtype (a `.to(bfloat16)` round trip would round it and skew the reference).
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    real = mask.bool()
    theirs = hf_outputs(model, ids, mask if use_mask else None)
    results = []
    ours = run_ours(args.bin, model_dir, ids, mask if use_mask else None, "f32", tmp)
    for name in ("logits", "hidden_states"):
        e = rel(ours[name][real], theirs[name][real])
        results.append((f"{desc} f32 {name}", e, 1e-4))
    if args.bf16:
        ours16 = run_ours(args.bin, model_dir, ids, mask if use_mask else None, "bf16", tmp)
        model16 = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        theirs16 = hf_outputs(model16, ids, mask if use_mask else None)
        for name in ("logits", "hidden_states"):
            e = rel(ours16[name][real], theirs[name][real])
            gate = 3 * rel(theirs16[name][real], theirs[name][real]) + 1e-3
            results.append((f"{desc} bf16 {name}", e, gate))
    return results


def fuzz_arguments(cases, *extra):
    """The command line both transformers fuzzes take (`extra`: (flag, help) switches), with
    transformers' logging and progress bars off."""
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=cases)
    for flag, why in extra:
        p.add_argument(flag, action="store_true", help=why)
    return p.parse_args()


def each_case(args, one_case, failures):
    """`one_case(args, rng, case_no, tmp)`'s results, case after case; a case whose flashgrpo run
    fails is a failure."""
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for case_no in range(args.cases):
            try:
                yield one_case(args, rng, case_no, tmp)
            except RuntimeError as e:
                failures.append(f"#{case_no} flashgrpo failed: {e}")


def main():
    args = fuzz_arguments(40, ("--bf16", "also run ours in bf16 against HF's bf16 error"))
    failures, checks, worst = [], 0, {}
    for results in each_case(args, one_case, failures):
        for desc, e, gate in results:
            checks += 1
            kind = desc.split()[-2] + " " + desc.split()[-1]
            worst[kind] = max(worst.get(kind, 0.0), e / gate)
            if not e <= gate:
                failures.append(f"{desc}: {e:.2e} > {gate:.2e}")
    print(f"{checks} checks, {len(failures)} failures; worst error / gate: "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(worst.items())))
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
