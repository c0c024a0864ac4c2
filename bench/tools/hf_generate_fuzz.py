"""`flashgrpo generate` (greedy) against transformers' `generate` on random Qwen2 configurations.

tests/peers/hf_generate.py checks one configuration; this draws many (hf_forward_fuzz.py's
configurations: MHA to MQA, an explicit `head_dim`, 1-3 layers, RoPE theta, tied or not), a batch
of 1-6 prompts of 1-20 tokens in one call (ours pads and decodes them together through the KV
cache; HF decodes each alone), 1-16 new tokens, a repetition penalty or none, and an
end-of-sequence id the model may emit. The completions' token ids must be equal. Where they
differ, HF's logits along our completion say whether the first differing step was a near-tie
(the two best logits within 1e-4 of the largest magnitude: f32 rounding may pick either), which
is counted apart; any other difference is a failure.

Usage: python hf_generate_fuzz.py --bin target/release/flashgrpo [--seed 1] [--cases 30]
"""

import json
import os
import subprocess
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen2ForCausalLM

from hf_forward_fuzz import draw_config, each_case, fuzz_arguments, make_model


def save(model, cfg, d):
    model.save_pretrained(d)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(os.path.join(d, "tokenizer.json"))


def ours_greedy(binary, d, prompts, penalty, new):
    path = os.path.join(d, "prompts.jsonl")
    with open(path, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt_ids": ids}) + "\n")
    r = subprocess.run([binary, "generate", "--model", d, "--prompts", path, "--temperature", "0",
                        "--repetition-penalty", str(penalty), "--max-new-tokens", str(new)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip()[-2000:])
    return [json.loads(line)["completion_ids"] for line in r.stdout.splitlines()]


def first_step_is_near_tie(model, prompt, ours, theirs, penalty):
    """Whether, at the first step where the completions differ, HF's processed scores (its logits
    after the repetition penalty) along the common prefix have their two best within 1e-4."""
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    ids = torch.tensor([prompt + ours[:k]])
    with torch.no_grad():
        scores = model(input_ids=ids).logits[0, -1].double()
    if penalty != 1.0:
        seen = torch.tensor(sorted(set(ids[0].tolist())))
        s = scores[seen]
        scores[seen] = torch.where(s < 0, s * penalty, s / penalty)
    top = torch.topk(scores, 2).values
    return (top[0] - top[1]).item() <= 1e-4 * scores.abs().max().item(), k


def one_case(args, rng, case_no, tmp):
    cfg = draw_config(rng)
    eos = rng.randrange(cfg["vocab_size"])
    cfg.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    model = make_model(cfg, rng.randrange(2**31), scale=rng.choice([3.0, 6.0, 10.0]))
    prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 6))]
    penalty, new = rng.choice([1.0, 1.0, 1.3, 0.8]), rng.randint(1, 16)
    d = os.path.join(tmp, f"m{case_no}")
    save(model, cfg, d)
    model = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = ours_greedy(args.bin, d, prompts, penalty, new)
    desc = f"#{case_no} {cfg} prompts={[len(p) for p in prompts]} penalty={penalty} new={new}"
    results = []
    for k, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, repetition_penalty=penalty, max_new_tokens=new,
                                 eos_token_id=eos, pad_token_id=eos)
        theirs = out[0, len(prompt):].tolist()
        if theirs and theirs[-1] == eos and eos in theirs[:-1]:
            theirs = theirs[:theirs.index(eos) + 1]
        mine = ours[k] if k < len(ours) else None
        if mine == theirs:
            results.append(("equal", desc))
            continue
        tie, step = first_step_is_near_tie(model, prompt, mine or [], theirs, penalty)
        results.append(("tie" if tie else "differ", f"{desc} prompt {k}: step {step}: ours {mine}, HF {theirs}"))
    return results


def main():
    args = fuzz_arguments(30)
    counts, failures, ties = {"equal": 0, "tie": 0, "differ": 0}, [], []
    for results in each_case(args, one_case, failures):
        for kind, what in results:
            counts[kind] += 1
            (failures if kind == "differ" else ties if kind == "tie" else []).append(what)
    print(f"{sum(counts.values())} completions: {counts['equal']} equal, {counts['tie']} differing after a near-tie, "
          f"{len(failures)} failures")
    for t in ties:
        print("TIE", t)
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
