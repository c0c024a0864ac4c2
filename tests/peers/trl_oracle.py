"""The trainer-level oracle: flashgrpo's GRPO update against TRL's `GRPOTrainer.compute_loss` on
the same weights and the same rollout batch (prompt ids, completion ids, masks, advantages, old
and reference log-probabilities), loss and every parameter's gradient, f32, relative error
<= 1e-4. Loss types grpo, dapo, dr_grpo and bnpo, beta 0 and 0.04 (with and without TRL's KL
bias correction, `use_bias_correction_kl`: on by default in TRL, off in LOSSES.md), ppo_epochs
(TRL's num_iterations) 1 and 2, tied and untied lm_head, prompts left-padded and completions
right-padded to different lengths. flashgrpo runs its trainer's own update
(`flashgrpo update-grads`) in two micro-batches whose losses must sum to TRL's one-batch loss.

Usage: python trl_oracle.py --bin PATH/TO/flashgrpo
"""

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

hf_logging.disable_progress_bar()

VOCAB, B, G, P, C = 97, 8, 4, 7, 6


def tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB)}
    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")))
    t.eos_token, t.pad_token = "t0", "t0"
    return t


def model(tied):
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, rope_theta=10000.0, rms_norm_eps=1e-6,
                      eos_token_id=0, pad_token_id=0)
    m = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # weights larger than the default initialisation; non-trivial biases and norms
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return m


def batch(with_old, with_ref):
    """Left-padded prompts of 3..P tokens (G completions each), right-padded completions of 1..C."""
    prompt_ids = torch.zeros(B, P, dtype=torch.int64)
    prompt_mask = torch.zeros(B, P, dtype=torch.int64)
    for g in range(B // G):
        n = 3 + (2 * g) % (P - 2)
        ids = torch.randint(1, VOCAB, (n,))
        for r in range(g * G, (g + 1) * G):
            prompt_ids[r, P - n:] = ids
            prompt_mask[r, P - n:] = 1
    completion_ids = torch.randint(1, VOCAB, (B, C))
    completion_mask = torch.zeros(B, C, dtype=torch.int64)
    for r in range(B):
        n = 1 + (r * 5) % C
        completion_mask[r, :n] = 1
        completion_ids[r, n:] = 0
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B),
    }
    # Log-probabilities near the model's (about -4.6 for 97 tokens), as an earlier policy's.
    if with_old:
        out["old_per_token_logps"] = (-4.6 + 0.3 * torch.randn(B, C)) * completion_mask
    if with_ref:
        out["ref_per_token_logps"] = (-4.6 + 0.3 * torch.randn(B, C)) * completion_mask
    return out


def trl_gradients(model_dir, tok, inputs, loss_type, beta, epochs, bias_correction, out_dir):
    config = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, per_device_train_batch_size=B,
                        gradient_accumulation_steps=1, num_generations=G, max_completion_length=C,
                        loss_type=loss_type, beta=beta, num_iterations=epochs, report_to="none",
                        use_bias_correction_kl=bias_correction,
                        save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                          args=config, train_dataset=Dataset.from_list([{"prompt": "t5 t6"}] * B),
                          processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    trl_inputs = dict(inputs)
    trl_inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    loss = trainer.compute_loss(trainer.model, trl_inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = tokenizer()
    failures, checks = [], 0
    # beta 0.04 with and without TRL's KL bias correction (its default is on, LOSSES.md's off).
    betas = [(0.0, False), (0.04, False), (0.04, True)]
    cases = itertools.product([True, False], ["grpo", "dapo", "dr_grpo", "bnpo"], betas, [1, 2])
    with tempfile.TemporaryDirectory() as d:
        for tied, loss_type, (beta, bias_correction), epochs in cases:
            name = f"tied={tied} {loss_type} beta={beta} bias_correction={bias_correction} ppo_epochs={epochs}"
            m = model(tied)
            model_dir = os.path.join(d, f"model-{tied}")
            m.save_pretrained(model_dir)
            inputs = batch(with_old=epochs > 1, with_ref=beta != 0.0)
            trl_loss, trl_grads = trl_gradients(model_dir, tok, inputs, loss_type, beta, epochs, bias_correction,
                                                os.path.join(d, "trl"))
            batch_file, grads_file = os.path.join(d, "batch.safetensors"), os.path.join(d, "grads.safetensors")
            save_file({k: v.contiguous() for k, v in inputs.items()}, batch_file)
            cmd = [args.bin, "update-grads", "--model", model_dir, "--batch", batch_file, "--out", grads_file,
                   "--micro-batch-size", str(B // 2), "--set", f"loss_type={loss_type}", "--set", f"beta={beta}",
                   "--set", f"max_completion_length={C}", "--set", f"use_bias_correction_kl={str(bias_correction).lower()}"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout, r.stderr)
                sys.exit(1)
            ours = load_file(grads_file)
            checks += 1
            loss_err = abs(ours["loss"].item() - trl_loss) / max(abs(trl_loss), 1e-3)
            worst = ("", 0.0)
            if not loss_err <= 1e-4:
                failures.append(f"{name}: loss {ours['loss'].item():.8e} vs TRL {trl_loss:.8e}")
            for pname, g in trl_grads.items():
                key = "model.embed_tokens.weight" if pname == "lm_head.weight" and tied else pname
                checks += 1
                if key not in ours:
                    failures.append(f"{name}: no gradient for {pname}")
                    continue
                e = ((ours[key].double() - g.double()).norm() / g.double().norm().clamp(min=1e-30)).item()
                worst = max(worst, (pname, e), key=lambda x: x[1])
                if not e <= 1e-4:
                    failures.append(f"{name}: {pname} relative error {e:.2e}")
            print(f"{name}: loss {trl_loss:+.6e} (relative difference {loss_err:.1e}), "
                  f"worst gradient {worst[0]} {worst[1]:.1e} over {len(trl_grads)} parameters")
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
