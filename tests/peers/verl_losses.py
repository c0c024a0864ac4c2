"""`flashgrpo loss` against verl's loss formulas, re-implemented here from verl's source.

verl is not on PyPI in a form that installs without its distributed stack, so its functions are
copied below from `verl/trainer/ppo/core_algos.py` at commit
b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29), changed only where they read a config
object (the values are passed as arguments) and with the metrics left out: `agg_loss`,
`compute_policy_loss_vanilla` (dual-clip PPO), `compute_policy_loss_gpg`,
`compute_policy_loss_geo_mean`, `compute_policy_loss_kl_cov`, `compute_policy_loss_clip_cov` (its
random draw made exhaustive: `clip_cov_ratio = 1` keeps every candidate, so verl's `randperm` does
not matter) and `kl_penalty_forward` (k1/kl, k2/mse, abs, low_var_kl). verl's actor adds the KL
loss as `pg_loss + kl_coef * agg_loss(kl, mask, loss_agg_mode)`, which is our `beta` term.
Checked in float64: the loss and its gradient with respect to the logits, f32 and bf16 logits, a
fully masked sequence (verl's seq-mean modes leave it out), rollout importance weights.

Usage: python verl_losses.py --bin PATH/TO/flashgrpo
"""

import argparse
import itertools
import sys

import torch
from loss_cli import close, close_norm, fail, report, run_loss

torch.manual_seed(0)
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"


# ---------------------------------------------------------------- verl, copied


def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low,
                        clip_ratio_high, clip_ratio_c, rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights=None):
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                         rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    return torch.mean(pg_losses)


def policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, kl_cov_ratio, ppo_kl_coef,
                       rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
                large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            ]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_cov_ratio,
                         cliprange_low, cliprange_high, clip_cov_lb, clip_cov_ub, rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


# ---------------------------------------------------------------- harness


# Our option names for verl's KL estimators (ours: `k3` is TRL's unclamped one).
KL_NAMES = {"k1": "k1", "mse": "k2", "abs": "abs", "low_var_kl": "low_var_kl"}


def verl_loss(policy, mode, logits, targets, mask, adv, old, ref, is_w, kl, p, dtype=torch.float64):
    """verl's loss and its gradient with respect to the logits, in float64 (or `dtype`)."""
    x = logits.to(dtype).requires_grad_(True)
    logp = torch.log_softmax(x, -1).gather(-1, targets[..., None]).squeeze(-1)
    A = adv.to(dtype)[:, None].expand_as(logp)
    m = mask.to(dtype)
    old = old.to(dtype)
    w = None if is_w is None else is_w.to(dtype)
    lo, hi = p["epsilon_low"], p["epsilon_high"]
    if policy == "vanilla":
        pg = policy_loss_vanilla(old, logp, A, m, mode, lo, hi, p["clip_ratio_c"], w)
    elif policy == "gpg":
        pg = policy_loss_gpg(old, logp, A, m, mode, w)
    elif policy == "geo_mean":
        pg = policy_loss_geo_mean(old, logp, A, m, lo, hi, w)
    elif policy == "kl_cov":
        pg = policy_loss_kl_cov(old, logp, A, m, mode, p["kl_cov_ratio"], p["ppo_kl_coef"], w)
    else:
        pg = policy_loss_clip_cov(old, logp, A, m, mode, 1.0, lo, hi, p["clip_cov_lb"], p["clip_cov_ub"], w)
    loss = pg
    if kl is not None:
        loss = loss + p["beta"] * agg_loss(kl_penalty_forward(logp, ref.to(dtype), kl), m, mode)
    loss.backward()
    return loss.detach(), x.grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    args = ap.parse_args()
    p = dict(epsilon_low=0.2, epsilon_high=0.28, clip_ratio_c=3.0, beta=0.05, kl_cov_ratio=0.1, ppo_kl_coef=0.1,
             clip_cov_lb=-0.3, clip_cov_ub=0.3)
    modes = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    cases = []
    for policy, mode in itertools.product(["vanilla", "gpg", "kl_cov", "clip_cov"], modes):
        cases.append((policy, mode, None, False))
    cases += [("vanilla", "token-mean", None, True), ("gpg", "seq-mean-token-mean", None, True),
              ("kl_cov", "token-mean", None, True), ("clip_cov", "seq-mean-token-sum", None, True)]
    cases += [("vanilla", mode, "low_var_kl", False) for mode in modes]
    cases += [("vanilla", "token-mean", kl, False) for kl in KL_NAMES]
    cases += [("geo_mean", "token-mean", None, False), ("geo_mean", "token-mean", "k1", False),
              ("geo_mean", "seq-mean-token-mean", "low_var_kl", True)]
    ours = {"vanilla": "bnpo", "gpg": "gpg", "geo_mean": "geo_mean", "kl_cov": "kl_cov", "clip_cov": "clip_cov"}
    for (policy, mode, kl, with_is), (B, T, V), dtype, c in itertools.product(
            cases, [(4, 7, 45), (3, 6, 130)], ["f32", "bf16"], [3.0, 1.1]):
        if c != 3.0 and policy != "vanilla":
            continue
        logits = torch.randn(B, T, V) * 2.5
        logits = logits.to(torch.bfloat16) if dtype == "bf16" else logits
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.25).float()
        mask[:, 0] = 1
        mask[1] = 0  # a sequence without tokens: verl's seq-mean modes leave it out
        adv = torch.randn(B)
        true = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
        old = (true + 0.3 * torch.randn(B, T)).float()
        ref = (true + 0.3 * torch.randn(B, T)).float() if kl else None
        is_w = (0.5 + torch.rand(B, T)).float() if with_is else None
        q = dict(p, clip_ratio_c=c)
        sets = {"loss_type": ours[policy], "loss_agg_mode": mode, "epsilon_low": q["epsilon_low"],
                "epsilon_high": q["epsilon_high"], "beta": q["beta"] if kl else 0.0,
                "kl_loss_type": KL_NAMES.get(kl, "k3"), "kl_cov_ratio": q["kl_cov_ratio"],
                "ppo_kl_coef": q["ppo_kl_coef"], "clip_cov_ratio": 1.0, "clip_cov_lb": q["clip_cov_lb"],
                "clip_cov_ub": q["clip_cov_ub"], "max_completion_length": T}
        if policy == "vanilla":
            sets["clip_ratio_c"] = c
        case = f"verl {policy} {mode} kl={kl} is={with_is} clip_ratio_c={c} B={B} T={T} V={V} {dtype}"
        try:
            out = run_loss(args.bin, "grpo", {"logits": logits, "targets": targets, "mask": mask, "advantages": adv,
                                      "old_logp": old, "ref_logp": ref, "is_ratio": is_w}, sets)
        except RuntimeError as e:
            fail(case, str(e))
            continue
        loss, grad = verl_loss(policy, mode, logits, targets, mask, adv, old, ref, is_w, kl, q)
        close(case, "loss", out["loss"], loss, 1e-5)
        close_norm(case, "grad_logits", out["grad_logits"], grad, 1e-2 if dtype == "bf16" else 1e-5)
    sys.exit(report(f"verl {VERL_COMMIT[:12]}"))


if __name__ == "__main__":
    main()
