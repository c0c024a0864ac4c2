"""`flashgrpo generate` against Hugging Face transformers' `generate`: a tiny random Qwen2 saved
with `save_pretrained` and a word-level tokenizer, greedy decoding with and without a repetition
penalty (HF's `RepetitionPenaltyLogitsProcessor` on the prompt's and the completion's tokens),
stopping at the config's end-of-sequence id. The completions' token ids must be equal.

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
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
