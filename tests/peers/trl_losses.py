"""`flashgrpo loss` against TRL 1.16's own loss code, for every option TRL 1.16 added.

TRL's `GRPOTrainer._compute_loss` is called unchanged (not re-implemented) on a stand-in trainer
whose `_get_per_token_logps_and_entropies` returns the log-probabilities and entropies of our
float64 logits, so autograd gives TRL's gradient with respect to the logits. The rollout
correction's ratio (`vllm_importance_sampling_mode`) is computed by TRL's own block of
`_generate_and_score_completions`, cut out of its source between its comments and executed as is.
The options: loss types grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo at token and sequence
level; `off_policy_mask_threshold`; `top_entropy_quantile`; TRL's entropy bonus (`entropy_coef`,
a masked mean outside the loss type's normaliser: our `entropy_bonus: masked_mean`); the four
rollout-correction modes with C_min / C_max; beta with and without `use_bias_correction_kl`;
delta; temperature; on- and off-policy; f32 and bf16 logits, ragged V, masked rows.

Usage: python trl_losses.py --bin PATH/TO/flashgrpo [--quick]
"""

import argparse
import collections
import functools
import inspect
import itertools
import math
import sys
import textwrap
import types
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from loss_cli import close, close_norm, fail, report, run_loss  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
import trl  # noqa: E402

torch.manual_seed(0)
# TRL's rollout-correction block, from its own source.
_SOURCE = inspect.getsource(GRPOTrainer._generate_and_score_completions)
_START = "# Compute the importance sampling ratio when using vLLM"
_END = "# Compute the per-token log probabilities for the reference model"
_block = _SOURCE[_SOURCE.index(_START):_SOURCE.index(_END)]
_indent = _SOURCE[:_SOURCE.index(_START)].rsplit("\n", 1)[1]
ROLLOUT_CORRECTION = compile(textwrap.dedent(_indent + _block), "trl-rollout-correction", "exec")


class Accelerator:
    """One process: every collective is the identity."""
    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t


def stand_in(o, logits, T):
    """The attributes `_compute_loss` reads, as `GRPOTrainer.__init__` sets them from `GRPOConfig`."""
    args = types.SimpleNamespace(
        delta=o["delta"], use_bias_correction_kl=o["use_bias_correction_kl"],
        sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        vespo_k_pos=o["vespo_k_pos"], vespo_lambda_pos=o["vespo_lambda_pos"],
        vespo_k_neg=o["vespo_k_neg"], vespo_lambda_neg=o["vespo_lambda_neg"],
        steps_per_generation=1, entropy_target=0.2)
    s = types.SimpleNamespace(
        args=args, model=types.SimpleNamespace(training=True), accelerator=Accelerator(),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        loss_type=o["loss_type"], importance_sampling_level=o["importance_sampling_level"],
        epsilon_low=o["epsilon_low"], epsilon_high=o["epsilon_high"], beta=o["beta"],
        top_entropy_quantile=o["top_entropy_quantile"], off_policy_mask_threshold=o["off_policy_mask_threshold"],
        use_vllm=o["mode"] is not None, vllm_importance_sampling_correction=o["mode"] is not None,
        vllm_importance_sampling_mode=o["mode"], vllm_importance_sampling_clip_min=o["clip_min"],
        vllm_importance_sampling_clip_max=o["clip_max"],
        entropy_coef=o["entropy_coef"], use_adaptive_entropy=False,
        _entropy_bonus_enabled=o["entropy_coef"] != 0.0,
        aux_loss_enabled=False, current_gradient_accumulation_steps=1, max_completion_length=T)
    s.get_high_entropy_mask = functools.partial(GRPOTrainer.get_high_entropy_mask, s)
    s.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    s.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return s


def trl_loss(o, logits, targets, mask, adv, old, ref, sampling, dtype=torch.float64):
    """TRL's loss and its gradient with respect to the logits (float64, or `dtype`: TRL's own
    rounding in float32, for bench/tools/logits_fuzz.py)."""
    B, T, V = logits.shape
    x = logits.to(dtype).requires_grad_(True)
    logsm = torch.log_softmax(x / o["temperature"], -1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    # TRL's entropies are float32 (its threshold is taken over `entropies[mask].float()`): the
    # values rounded to float32, the gradient of the float64 ones.
    entropy = entropy + (entropy.float().to(dtype) - entropy).detach()
    s = stand_in(o, logits, T)
    s._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    m = mask.long()
    inputs = {"prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
              "completion_ids": targets, "completion_mask": m, "advantages": adv.to(dtype),
              "num_items_in_batch": mask.sum().to(dtype)}
    # TRL always scores the old policy when it corrects for the sampler; on-policy it is logp itself.
    old_ = logp.detach() if old is None else old.to(dtype)
    if old is not None:
        inputs["old_per_token_logps"] = old_
    if ref is not None:
        inputs["ref_per_token_logps"] = ref.to(dtype)
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling.to(dtype)
        if o["mode"] is not None:
            env = {"self": s, "torch": torch, "math": math, "old_per_token_logps": old_,
                   "sampling_per_token_logps": sampling.to(dtype), "completion_mask": m, "tool_mask": None}
            exec(ROLLOUT_CORRECTION, env)
            inputs["importance_sampling_ratio"] = env["vllm_importance_sampling_ratio"]
    loss = GRPOTrainer._compute_loss(s, None, inputs)
    loss.backward()
    return loss.detach(), x.grad


def options(**kw):
    o = dict(loss_type="dapo", importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.28, delta=None,
             beta=0.0, use_bias_correction_kl=False, temperature=1.0, top_entropy_quantile=1.0,
             off_policy_mask_threshold=None, entropy_coef=0.0, mode=None, clip_min=None, clip_max=3.0,
             vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    o.update(kw)
    return o


def our_sets(o, T):
    s = {k: o[k] for k in ["loss_type", "importance_sampling_level", "epsilon_low", "epsilon_high", "delta", "beta",
                           "use_bias_correction_kl", "temperature", "top_entropy_quantile",
                           "off_policy_mask_threshold", "entropy_coef", "vespo_k_pos", "vespo_lambda_pos",
                           "vespo_k_neg", "vespo_lambda_neg"]}
    s["entropy_bonus"] = "masked_mean"  # TRL 1.16's form
    s["max_completion_length"] = T
    s["vllm_importance_sampling_correction"] = o["mode"] is not None
    if o["mode"] is not None:
        s.update(vllm_importance_sampling_mode=o["mode"], vllm_importance_sampling_clip_min=o["clip_min"],
                 vllm_importance_sampling_clip_max=o["clip_max"])
    return {k: v for k, v in s.items() if v is not None or k in ("delta", "off_policy_mask_threshold")}


def cases(quick):
    loss_types = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
    variants = [
        dict(),
        dict(beta=0.04, use_bias_correction_kl=True, temperature=0.8),
        dict(off_policy_mask_threshold=0.0),
        dict(top_entropy_quantile=0.3, entropy_coef=0.03),
        dict(top_entropy_quantile=0.0),  # TRL's lower end: the highest-entropy token alone
        dict(entropy_coef=0.05, beta=0.04),
        dict(mode="token_truncate", clip_min=0.9, clip_max=1.05),
        dict(mode="token_mask", clip_min=0.9, clip_max=1.05),
        dict(mode="sequence_truncate", clip_min=0.5, clip_max=1.2),
        dict(mode="sequence_mask", clip_min=0.5, clip_max=1.2),
        dict(mode="token_mask", clip_max=1.05, off_policy_mask_threshold=0.02, top_entropy_quantile=0.5,
             entropy_coef=0.02, delta=1.3, beta=0.04),
    ]
    for i, (lt, level, v) in enumerate(itertools.product(loss_types, ["token", "sequence"], variants)):
        if lt == "vespo" and v.get("mode", "token").startswith("sequence"):
            continue  # TRL refuses it; so do we
        if quick and i % 3:
            continue
        eps_high = 4.0 if lt == "cispo" else 0.28
        yield options(loss_type=lt, importance_sampling_level=level, epsilon_high=eps_high, **v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shapes = [(4, 7, 45), (3, 5, 130)]
    for n, o in enumerate(cases(args.quick)):
        for (B, T, V), dtype, policy in itertools.product(shapes, ["f32", "bf16"], ["off", "on"]):
            if (dtype == "bf16") and (n + len(policy)) % 2:
                continue
            logits = torch.randn(B, T, V) * 2.5
            logits = logits.to(torch.bfloat16) if dtype == "bf16" else logits
            targets = torch.randint(0, V, (B, T))
            mask = (torch.rand(B, T) > 0.25).float()
            mask[:, 0] = 1
            mask[-1, 2:] = 0  # a short sequence
            adv = torch.randn(B)
            true = torch.log_softmax(logits.double() / o["temperature"], -1).gather(-1, targets[..., None]).squeeze(-1)
            old = (true + 0.2 * torch.randn(B, T)).float() if policy == "off" else None
            ref = (true + 0.3 * torch.randn(B, T)).float() if o["beta"] != 0 else None
            uses_sampling = o["mode"] is not None or o["off_policy_mask_threshold"] is not None
            sampling = (true + 0.1 * torch.randn(B, T)).float() if uses_sampling else None
            if sampling is not None:
                sampling[0, 1] = float("nan")  # a token the sampler could not score
            case = f"trl {o} B={B} T={T} V={V} {dtype} {policy}-policy"
            try:
                out = run_loss(args.bin, "grpo", {"logits": logits, "targets": targets, "mask": mask, "advantages": adv,
                                          "old_logp": old, "ref_logp": ref, "sampling_logp": sampling},
                               our_sets(o, T))
            except RuntimeError as e:
                fail(case, str(e))
                continue
            loss, grad = trl_loss(o, logits, targets, mask, adv, old, ref, sampling)
            close(case, "loss", out["loss"], loss, 1e-5)
            close_norm(case, "grad_logits", out["grad_logits"], grad, 1e-2 if dtype == "bf16" else 1e-5)
    sys.exit(report(f"TRL {trl.__version__}"))


if __name__ == "__main__":
    main()
