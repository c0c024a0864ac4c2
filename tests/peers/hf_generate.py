"""`flashgrpo generate` against Hugging Face transformers' `generate`: a tiny random Qwen2 saved
with `save_pretrained` and a word-level tokenizer.
- Greedy decoding with and without a repetition penalty (HF's `RepetitionPenaltyLogitsProcessor`
  on the prompt's and the completion's tokens), stopping at the config's end-of-sequence id: the
  completions' token ids must be equal.
- Sampling with temperature, top-k, top-p, min-p and the penalty: many one-token draws of ours
  against the distribution of HF's processed scores (`output_scores`): no token HF filters out,
  and the frequencies within a chi-square bound (false alarms ~1e-6).

Usage: python hf_generate.py --bin PATH/TO/flashgrpo
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB, EOS, NEW = 151, 150, 12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    failures, checks = [], 0
    # A larger initialisation than the default, so that greedy choices are not near-ties.
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                      initializer_range=0.15, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=EOS)
    model = Qwen2ForCausalLM(cfg).float().eval()
    # Prompts that repeat tokens, so that the penalty has something to act on from the start.
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (3, 5, 8, 10, 4, 7)]
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        words.save(os.path.join(d, "tokenizer.json"))
        path = os.path.join(d, "prompts.jsonl")
        with open(path, "w") as f:
            for ids in prompts:
                f.write(json.dumps({"prompt_ids": ids}) + "\n")
        plain = None
        for penalty in (1.0, 1.3, 2.0, 0.8):
            r = subprocess.run([args.bin, "generate", "--model", d, "--prompts", path, "--temperature", "0",
                                "--repetition-penalty", str(penalty), "--max-new-tokens", str(NEW)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr)
                sys.exit(1)
            ours = [json.loads(line)["completion_ids"] for line in r.stdout.splitlines()]
            theirs = []
            for ids in prompts:
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         do_sample=False, repetition_penalty=penalty, max_new_tokens=NEW,
                                         eos_token_id=EOS, pad_token_id=EOS)
                theirs.append(out[0, len(ids):].tolist())
            for k, (a, b) in enumerate(zip(ours, theirs)):
                checks += 1
                if a != b:
                    failures.append(f"penalty {penalty} prompt {k}: ours {a}, transformers {b}")
            if len(ours) != len(theirs):
                failures.append(f"penalty {penalty}: {len(ours)} completions, expected {len(theirs)}")
            changed = "" if plain is None else f", {sum(a != b for a, b in zip(theirs, plain))} changed by the penalty"
            print(f"repetition_penalty {penalty}: {sum(a == b for a, b in zip(ours, theirs))} of {len(theirs)} "
                  f"completions equal{changed}")
            if penalty == 1.0:
                plain = theirs
            elif theirs == plain:
                failures.append(f"penalty {penalty} changed no completion: the check would not see it")
        c, f = check_sampling(args.bin, model, d, prompts[3])
        checks, failures = checks + c, failures + f
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


def check_sampling(binary, model, d, prompt, draws=6000):
    checks, failures = 0, []
    path = os.path.join(d, "one.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"prompt_ids": prompt}) + "\n")
    for temperature, top_k, top_p, min_p, penalty in [(1.0, 5, 1.0, 0.0, 1.0), (0.7, 0, 0.8, 0.0, 1.0),
                                                      (1.0, 0, 1.0, 0.1, 1.0), (1.3, 20, 0.9, 0.05, 1.5),
                                                      (2.0, 0, 1.0, 0.0, 1.2)]:
        name = f"T={temperature} top_k={top_k} top_p={top_p} min_p={min_p} penalty={penalty}"
        r = subprocess.run([binary, "generate", "--model", d, "--prompts", path, "--max-new-tokens", "1",
                            "--num-generations", str(draws), "--seed", "3", "--temperature", str(temperature),
                            "--top-k", str(top_k), "--top-p", str(top_p), "--min-p", str(min_p),
                            "--repetition-penalty", str(penalty)], capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr)
            sys.exit(1)
        counts = torch.zeros(VOCAB)
        for line in r.stdout.splitlines():
            counts[json.loads(line)["completion_ids"][0]] += 1
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                 min_p=min_p if min_p > 0 else None, repetition_penalty=penalty, max_new_tokens=1,
                                 eos_token_id=EOS, pad_token_id=EOS, output_scores=True,
                                 return_dict_in_generate=True)
        p = torch.softmax(out.scores[0][0].double(), -1)
        checks += 1
        outside = [t for t in range(VOCAB) if counts[t] > 0 and p[t] == 0]
        expected = p * draws
        own = expected >= 20
        chi2 = (((counts[own] - expected[own]) ** 2) / expected[own]).sum().item()
        pooled_e, pooled_o = expected[~own].sum().item(), counts[~own].sum().item()
        if pooled_e > 0:
            chi2 += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        dof = max(int(own.sum().item()), 1)
        bound = dof * (1 - 2 / (9 * dof) + 4.75 * (2 / (9 * dof)) ** 0.5) ** 3
        kept = int((p > 0).sum().item())
        print(f"sampling {name}: {kept} tokens kept by transformers, {int((counts > 0).sum().item())} drawn, "
              f"chi2 {chi2:.1f} (bound {bound:.1f})")
        if outside:
            failures.append(f"{name}: drew tokens transformers filters out: {outside}")
        if not chi2 < bound:
            failures.append(f"{name}: chi2 {chi2:.1f} over {dof} cells, bound {bound:.1f}")
    return checks, failures


if __name__ == "__main__":
    main()
