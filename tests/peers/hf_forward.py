"""`flashgrpo forward` against Hugging Face transformers: a tiny random Qwen2 saved with
`save_pretrained` (tied and untied embeddings, GQA, biases), token ids with right and left
padding; the logits and last hidden states must match within 1e-4 relative (f32).

Usage: python hf_forward.py --bin PATH/TO/flashgrpo
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    failures, checks = [], 0
    for tied in (True, False):
        cfg = Qwen2Config(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=tied, rope_theta=10000.0, rms_norm_eps=1e-6)
        model = Qwen2ForCausalLM(cfg).float().eval()
        with torch.no_grad():  # make biases and norms non-trivial
            for name, p_ in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p_.add_(0.1 * torch.randn_like(p_))
        ids = torch.randint(0, cfg.vocab_size, (3, 10))
        mask = torch.ones(3, 10, dtype=torch.int64)
        mask[1, 7:] = 0  # right padding
        mask[2, :3] = 0  # left padding
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            inp, out = os.path.join(d, "ids.safetensors"), os.path.join(d, "out.safetensors")
            for with_mask in (False, True):
                tensors = {"input_ids": ids} | ({"attention_mask": mask} if with_mask else {})
                save_file(tensors, inp)
                r = subprocess.run([args.bin, "forward", "--model", d, "--inputs", inp, "--out", out],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    print(r.stderr)
                    sys.exit(1)
                ours = load_file(out)
                with torch.no_grad():
                    theirs = model(input_ids=ids, attention_mask=mask if with_mask else None, output_hidden_states=True)
                real = mask.bool() if with_mask else torch.ones_like(mask, dtype=torch.bool)
                for name, a, b in [("logits", ours["logits"], theirs.logits),
                                   ("hidden_states", ours["hidden_states"], theirs.hidden_states[-1])]:
                    checks += 1
                    e = rel(a[real], b[real])
                    print(f"tied={tied} mask={with_mask} {name}: max relative difference {e:.2e} (real tokens)")
                    if not e <= 1e-4:
                        failures.append(f"tied={tied} mask={with_mask} {name} {e:.2e}")
                    if with_mask:
                        e_all = rel(a, b)
                        print(f"tied={tied} mask={with_mask} {name}: {e_all:.2e} over every position, padding included")
                        if not e_all <= 1e-4:
                            failures.append(f"tied={tied} mask={with_mask} {name} (padding included) {e_all:.2e}")
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
