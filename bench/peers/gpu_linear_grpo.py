"""The GPU peers of `flashgrpo bench --device cuda` with `impl: fused-linear`: GRPO forward + backward
from hidden states and an lm_head, at one shape, on the same GPU in the same run, with the
distribution of flashgrpo's bench (hidden N(0, 1), lm_head N(0, 2^2 / H) so that the logits are
N(0, 2^2), 10% of rows masked, old / ref log-probs near the true ones, dapo, beta = 0.04, eps 0.2 /
0.28, temperature 1):

- torch-eager: the logits materialised (`hidden @ weight.T`, in the inputs' dtype, as a model's
  lm_head gives them), then TRL's `_compute_loss` written out in f32 (bench/peers/gpu_grpo.py's
  `trl_grpo`), autograd back to the hidden states and the lm_head;
- torch-compile: the same function under `torch.compile`;
- liger: Liger-Kernel's `LigerFusedLinearGRPOLoss` with its defaults on a GPU (`compiled=True`,
  `chunk_size=1`: one sequence a chunk, so B=1 is one chunk of T rows), which is what TRL uses
  with `use_liger_kernel`.

Each step is timed by CUDA events (median of --steps after --warmup); `gflops` counts the three
products (logits, d hidden, d weight: 6 N H V flops) over the step, as `flashgrpo bench` does.
Memory is torch's allocator: `step_extra_bytes` is the peak during the step above what was allocated
when it started (inputs and the gradients of earlier steps, set to None before each step).

Prints one JSON object per line, one per peer (with `loss_rel_to_first`, its loss against the first
peer's on the same inputs).

Usage: python gpu_linear_grpo.py --batch 1 --seq-len 2048 --hidden 1536 --vocab 151936 --dtype bf16
                                 [--peers torch-eager,torch-compile,liger] [--warmup 3] [--steps 10]
                                 [--device cuda|cpu]

`--device cpu` (host clocks, no memory figures, Liger uncompiled) is for checking the script itself
on a machine without a GPU (the test suite does).
"""

import argparse
import statistics

import torch

import gpu_grpo
from gpu_grpo import BETA, EPS_HIGH, EPS_LOW, LOGIT_STD, LOGP_NOISE, MASK_FRACTION, Timer, memory


def inputs(b, t, h, v, dtype, seed=0):
    device = gpu_grpo.DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(b, t, h, device=device, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=g) * (LOGIT_STD / h**0.5)).to(dtype)
    ids = torch.randint(0, v, (b, t), device=device, generator=g)
    with torch.no_grad():
        base = torch.empty(b, t, device=device)
        for i in range(b):  # a sequence at a time: no [B, T, V] f32 temporary
            logits = (hidden[i] @ weight.T).float()
            base[i] = torch.gather(logits.log_softmax(-1), -1, ids[i].unsqueeze(-1)).squeeze(-1)
            del logits
    old = base + LOGP_NOISE * torch.randn(b, t, device=device, generator=g)
    ref = base + LOGP_NOISE * torch.randn(b, t, device=device, generator=g)
    adv = torch.randn(b, device=device, generator=g)
    mask = (torch.rand(b, t, device=device, generator=g) > MASK_FRACTION).float()
    mask[:, 0] = 1.0
    return hidden, weight, ids, old, ref, adv, mask


def loss_function(peer, ids, old, ref, adv, mask):
    """The peer's loss of (hidden, weight)."""
    if peer == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        module = LigerFusedLinearGRPOLoss(beta=BETA, compiled=gpu_grpo.DEVICE == "cuda", use_ref_model=True,
                                          chunk_size=1, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo")

        def liger(hidden, weight):
            out = module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
            return out[0] if isinstance(out, tuple) else out

        return liger

    def materialised(hidden, weight):
        return gpu_grpo.trl_grpo(hidden @ weight.T, ids, old, ref, adv, mask)

    return torch.compile(materialised) if peer == "torch-compile" else materialised


def time_peer(peer, args, dtype):
    b, t, h, v = args.batch, args.seq_len, args.hidden, args.vocab
    hidden, weight, ids, old, ref, adv, mask = inputs(b, t, h, v, dtype)
    loss_fn = loss_function(peer, ids, old, ref, adv, mask)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    times, extras, loss_value = [], [], None
    for i in range(args.warmup + args.steps):
        hidden.grad = None
        weight.grad = None
        gpu_grpo.synchronize_and_reset_peak()
        before = memory("allocated")
        timer = Timer()
        timer.start()
        loss = loss_fn(hidden, weight)
        loss.backward()
        elapsed = timer.stop()
        if i >= args.warmup:
            times.append(elapsed)
            extras.append(memory("peak") - before)
        loss_value = float(loss.detach())
        del loss
    p50 = statistics.median(times)
    return {
        "peer": peer,
        "batch": b,
        "seq_len": t,
        "hidden": h,
        "vocab": v,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if gpu_grpo.DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": len(times),
        "step_s_p50": p50,
        "step_s_min": min(times),
        "gflops": 6 * b * t * h * v / p50 / 1e9,
        "loss": loss_value,
        "step_extra_bytes": max(extras),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu_grpo.common_arguments(p, seq_len=2048)
    p.add_argument("--hidden", type=int, default=1536)
    gpu_grpo.run_peers(time_peer, p.parse_args())


if __name__ == "__main__":
    main()
