"""TRL's GRPOTrainer with flashgrpo's loss (examples/trl_grpo.py's FlashGRPOTrainer) against
TRL's own loss: two training steps each, from the same tiny model, seed and prompts; the logged
loss and gradient norm of each step and every parameter after the two steps equal within 1e-5.
Loss types dapo, grpo (with beta 0.04 and TRL's reference model), bnpo and dr_grpo, with and
without gradient accumulation. SGD, so that a gradient's rounding moves a weight by as little
(Adam's normalised step would turn a near-zero gradient's rounding into a full step).
Prints "N checks, 0 failures"."""

import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples"))
sys.path.insert(0, os.path.join(here, "..", "peers"))

import torch  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import trl_grpo  # noqa: E402
from loss_cli import CHECKS, FAILURES, close, report  # noqa: E402

CASES = [
    dict(loss_type="dapo", beta=0.0, gradient_accumulation_steps=1),
    dict(loss_type="grpo", beta=0.04, gradient_accumulation_steps=2),
    dict(loss_type="bnpo", beta=0.0, gradient_accumulation_steps=1, temperature=0.8),
    dict(loss_type="dr_grpo", beta=0.0, gradient_accumulation_steps=2),
]


def run(kind, model_dir, tokenizer, out_dir, case):
    torch.manual_seed(0)
    trainer = trl_grpo.make_trainer(kind, model_dir, tokenizer, out_dir, 2, optim="sgd", **case)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return logs, params


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        model_dir, tokenizer = trl_grpo.tiny_model_and_tokenizer(os.path.join(d, "model"))
        for case in CASES:
            name = f"TRL GRPOTrainer {case}"
            trl_logs, trl_params = run("trl", model_dir, tokenizer, os.path.join(d, "trl"), case)
            our_logs, our_params = run("flashgrpo", model_dir, tokenizer, os.path.join(d, "ours"), case)
            CHECKS[0] += 1
            if len(trl_logs) != 2 or len(our_logs) != 2:
                FAILURES.append(f"{name}: {len(trl_logs)} and {len(our_logs)} logged steps, expected 2")
                continue
            for step, (t, o) in enumerate(zip(trl_logs, our_logs), 1):
                for key in ["loss", "grad_norm", "reward"]:
                    close(name, f"step {step} {key}", torch.tensor(o[key]), torch.tensor(t[key]), 1e-5)
            for n, p in trl_params.items():
                close(name, f"{n} after two steps", our_params[n], p, 1e-5)
            print(f"{name}: losses {[e['loss'] for e in trl_logs]} (TRL) {[e['loss'] for e in our_logs]} (flashgrpo)")
    sys.exit(report("TRL GRPOTrainer with flashgrpo's loss"))


if __name__ == "__main__":
    main()
