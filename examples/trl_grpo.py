"""TRL's GRPOTrainer with flashgrpo's fused-linear GRPO loss, on the CPU.

`FlashGRPOTrainer` is TRL's `GRPOTrainer` with one method replaced: the loss is computed from the
policy's last hidden states and its lm_head by `flashgrpo.torch.fused_linear_grpo_loss`, streamed
over the vocabulary, instead of TRL's per-token log-probabilities and loss code. Everything else
(generation, rewards, advantages, the reference model, the optimiser, logging) is TRL's. The loss
and the gradients are TRL's (tests/python/test_trl.py: two training steps of each, equal within
1e-5).

Run it (a tiny Qwen2 model made from scratch, no download; or `--model DIR` for a Hugging Face
model directory and `--prompts` for your own prompts):

    python examples/trl_grpo.py --steps 4              # flashgrpo's loss
    python examples/trl_grpo.py --steps 4 --loss trl   # TRL's own, for comparison

Supported TRL options: loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo), beta (with the
reference log-probabilities TRL computes), epsilon / epsilon_high, delta, temperature,
importance_sampling_level, use_bias_correction_kl, top_entropy_quantile, a static entropy_coef,
gradient accumulation. Others (vLLM's importance sampling, the off-policy mask, adaptive entropy,
vespo, tool masks, MoE auxiliary losses) raise rather than silently differ.
"""

import argparse
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import flashgrpo.torch as ft  # noqa: E402


class FlashGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is flashgrpo's fused-linear GRPO loss."""

    def _check_supported(self, inputs):
        unsupported = {
            "use_vllm with importance sampling": self.use_vllm and self.vllm_importance_sampling_correction,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "adaptive entropy": self.use_adaptive_entropy,
            "loss_type vespo": self.loss_type == "vespo",
            "tool_mask": "tool_mask" in inputs,
            "MoE auxiliary loss": self.aux_loss_enabled,
        }
        for what, on in unsupported.items():
            if on:
                raise NotImplementedError(f"FlashGRPOTrainer: {what} is not supported; use GRPOTrainer")

    def _compute_loss(self, model, inputs):
        self._check_supported(inputs)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        length = completion_ids.size(1)
        # The hidden states that predict each completion token, and the head that scores them.
        unwrapped = self.accelerator.unwrap_model(model)
        hidden = unwrapped.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = hidden[:, -length - 1:-1, :]
        head = unwrapped.get_output_embeddings()

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        options = dict(loss_type=self.loss_type, beta=self.beta, epsilon_low=self.epsilon_low,
                       epsilon_high=self.epsilon_high, temperature=self.temperature,
                       importance_sampling_level=self.importance_sampling_level,
                       use_bias_correction_kl=self.args.use_bias_correction_kl,
                       max_completion_length=self.max_completion_length,
                       top_entropy_quantile=self.top_entropy_quantile, delta=self.args.delta,
                       sapo_temperature_pos=self.args.sapo_temperature_pos,
                       sapo_temperature_neg=self.args.sapo_temperature_neg)
        if self.loss_type in ("cispo", "dapo"):
            # TRL's normaliser: the generation batch's tokens, rescaled to one accumulation window.
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            options["num_items"] = float(items)
        if self._entropy_bonus_enabled:
            # TRL divides the bonus by the accumulation steps; the other loss types' division below
            # does that already.
            per_window = accumulation if self.loss_type in ("cispo", "dapo") else 1.0
            options.update(entropy_coef=self.entropy_coef / per_window, entropy_bonus="masked_mean")
        advantages = inputs["advantages"]
        out = ft.fused_linear_grpo_loss(
            hidden, head.weight, completion_ids, advantages.reshape(-1), completion_mask,
            bias=getattr(head, "bias", None), old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None, **options)
        loss = out.loss if self.loss_type in ("cispo", "dapo") else out.loss / accumulation
        self._log_metrics(mode, out, completion_mask)
        return loss

    def _log_metrics(self, mode, out, mask):
        m = mask.to(torch.float32)
        count = m.sum().clamp(min=1.0)
        self._metrics[mode]["entropy"].append((out.entropy * m).sum().item() / count.item())
        if self.beta != 0.0 and out.kl is not None:
            self._metrics[mode]["kl"].append(((out.kl * m).sum() / count).item())
        if out.is_clipped is not None:
            self._metrics[mode]["clip_ratio/region_mean"].append(((out.is_clipped * m).sum() / count).item())


# ---------------------------------------------------------------- a tiny run, no download

VOCAB = 64


def tiny_model_and_tokenizer(directory, seed=0):
    """A 2-layer Qwen2 over a 64-token word-level vocabulary, saved to `directory`; returns the
    directory and the tokenizer (passed to the trainer as it is: loaded back by `AutoTokenizer`,
    the model's type would make it a Qwen2 BPE tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0")
    tokenizer.padding_side = "left"
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    Qwen2ForCausalLM(config).float().save_pretrained(directory)
    return directory, tokenizer


def reward_even_tokens(completions, **kwargs):
    """A verifiable toy reward: the fraction of even token ids in the completion."""
    out = []
    for c in completions:
        ids = [int(w[1:]) for w in c.split() if w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


def make_trainer(kind, model_dir, tokenizer, output_dir, steps, **config):
    from datasets import Dataset

    args = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, seed=0, max_steps=steps,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                      learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                      model_init_kwargs={"dtype": torch.float32}, **config)
    prompts = [{"prompt": " ".join(f"t{(3 * i + j) % VOCAB + 1}" for j in range(4))} for i in range(64)]
    cls = FlashGRPOTrainer if kind == "flashgrpo" else GRPOTrainer
    return cls(model=model_dir, reward_funcs=[reward_even_tokens], args=args,
               train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", choices=["flashgrpo", "trl"], default="flashgrpo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny Qwen2 made here)")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if a.model:
            from transformers import AutoTokenizer

            model_dir, tokenizer = a.model, AutoTokenizer.from_pretrained(a.model)
        else:
            model_dir, tokenizer = tiny_model_and_tokenizer(os.path.join(d, "model"))
        trainer = make_trainer(a.loss, model_dir, tokenizer, os.path.join(d, "out"), a.steps, loss_type=a.loss_type,
                               beta=a.beta)
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.6f} reward {entry.get('reward', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
