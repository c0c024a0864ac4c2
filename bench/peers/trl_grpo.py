"""TRL's GRPOTrainer on the CPU, as the trainer peer of `flashgrpo bench-trainer`, which runs
this script with the settings of its own run and prints both side by side.

The model is a Hugging Face directory (flashgrpo's SFT warm start, `OUT/warm_start`); the prompts
are the task's prompts already rendered with the run's chat template (a JSONL file of
{"prompt", "prompt_ids", "answer"} that `flashgrpo bench-trainer` writes), fed to TRL as plain
text (TRL then applies no template), and checked to tokenize to the same ids; the rewards are
the same three functions with the same weights (bench/peers/rewards.py). Timing per optimiser
step: the step's wall time (a TrainerCallback), generation (`_generate_single_turn`), and
scoring (the rest of `_generate_and_score_completions`: rewards, advantages, log-probabilities);
the update is the step minus both. One JSON line per step, then one summary line.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rewards import trl_reward_funcs  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self, record):
        self.record = record
        self.started = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.record["step_s"] = time.perf_counter() - self.started


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--multi-objective-aggregation", default="sum_then_normalize")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--use-bias-correction-kl", default="false", choices=["true", "false"])
    ap.add_argument("--epsilon", type=float, default=0.2)
    ap.add_argument("--epsilon-high", type=float, default=0.2)
    ap.add_argument("--scale-rewards", default="group")
    ap.add_argument("--reward-weights", default="1.0,0.5,0.5")
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in open(args.prompts)]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mismatched = sum(
        tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] != r["prompt_ids"] for r in rows[:500]
    )
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    batch = args.prompts_per_step * args.num_generations
    if batch % args.micro_batch_size:
        raise SystemExit("prompts_per_step * num_generations must be a multiple of micro_batch_size")
    config = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        bf16=False,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=batch // args.micro_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p if args.min_p > 0 else None,
        repetition_penalty=args.repetition_penalty,
        multi_objective_aggregation=args.multi_objective_aggregation,
        loss_type=args.loss_type,
        beta=args.beta,
        use_bias_correction_kl=args.use_bias_correction_kl == "true",
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        scale_rewards=args.scale_rewards,
        reward_weights=[float(w) for w in args.reward_weights.split(",")],
        num_iterations=args.ppo_epochs,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        weight_decay=args.weight_decay,
        optim="adamw_torch",
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    record = {}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward_funcs(),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer(record)],
    )

    def timed(name, f):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                record[name] = record.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    trainer._generate_single_turn = timed("rollout_s", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("generate_and_score_s", trainer._generate_and_score_completions)

    steps = []

    class Report(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            r = dict(record)
            record.clear()
            step = {
                "step": state.global_step,
                "step_s": r.get("step_s", float("nan")),
                "rollout_s": r.get("rollout_s", 0.0),
                "score_s": r.get("generate_and_score_s", 0.0) - r.get("rollout_s", 0.0),
            }
            step["update_s"] = step["step_s"] - r.get("generate_and_score_s", 0.0)
            steps.append(step)
            print(json.dumps(step), flush=True)

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Report())
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    rewards = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    med = lambda k: statistics.median(s[k] for s in steps[1:] or steps)  # noqa: E731
    print(
        json.dumps(
            {
                "summary": True,
                "impl": "trl",
                "trl": __import__("trl").__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "steps": len(steps),
                "step_s_p50": med("step_s"),
                "rollout_s_p50": med("rollout_s"),
                "score_s_p50": med("score_s"),
                "update_s_p50": med("update_s"),
                "total_s": total,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "reward_first": rewards[0] if rewards else None,
                "reward_last": rewards[-1] if rewards else None,
                "completion_len_mean": statistics.mean(lengths) if lengths else None,
                "prompt_token_mismatches": mismatched,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
