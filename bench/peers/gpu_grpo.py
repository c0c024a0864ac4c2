"""The GPU peers of `flashgrpo bench --device cuda`: GRPO forward + backward on materialised logits
at one shape, timed on the same GPU in the same run, with the same inputs' distribution as
flashgrpo's bench (logits N(0, 2^2), 10% of rows masked, old / ref log-probs near the true ones,
dapo, beta = 0.04, eps 0.2 / 0.28, temperature 1):

- torch-eager: TRL's `_compute_loss` written out (log_softmax in f32, gather, ratio, clamp, min, k3
  KL, masked mean), autograd;
- torch-compile: the same function under `torch.compile`;
- liger: Liger-Kernel's Triton `triton_grpo_loss` (in place: the gradient overwrites the logits).
  Liger takes `[B, T+1, V]` logits and drops the last position, so it gets one extra row per
  sequence (0.02% more work at T = 4096).

Also the device-to-device copy bandwidth. Each step is timed by CUDA events (median of --steps
after --warmup); memory is torch's allocator: `step_extra_bytes` is the peak during the step above
what was allocated when it started (the inputs), `peak_bytes` the absolute peak during the step
minus the pristine copy kept to restore in-place logits.

Prints one JSON object per line: one per peer (with `loss_rel_to_first`, its loss against the first
peer's on the same inputs), then {"copy_gbps": ...}.

Usage: python gpu_grpo.py --batch 1 --seq-len 4096 --vocab 151936 --dtype bf16
                          [--peers torch-eager,torch-compile,liger] [--warmup 3] [--steps 10]
                          [--device cuda|cpu]

`--device cpu` (host clocks, no memory figures, no Liger) is for checking the script itself on a
machine without a GPU (the test suite does).
"""

import argparse
import json
import statistics
import time

import torch

DEVICE = "cuda"


class Timer:
    """CUDA events on the GPU, the host clock on the CPU."""

    def __init__(self):
        self.cuda = DEVICE == "cuda"

    def start(self):
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        """Seconds since start()."""
        if self.cuda:
            self.events[1].record()
            torch.cuda.synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return time.perf_counter() - self.t0


def memory(what):
    """torch's CUDA allocator figures (0 on the CPU)."""
    if DEVICE != "cuda":
        return 0
    return {"allocated": torch.cuda.memory_allocated, "peak": torch.cuda.max_memory_allocated}[what]()


def synchronize_and_reset_peak():
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

EPS_LOW, EPS_HIGH, BETA, LOGIT_STD, MASK_FRACTION, LOGP_NOISE = 0.2, 0.28, 0.04, 2.0, 0.1, 0.3


def trl_grpo(logits, ids, old, ref, adv, mask):
    """TRL's GRPO loss (dapo: the masked sum over the batch's active tokens)."""
    logp = torch.gather(logits.float().log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv[:, None])
    delta = ref - logp
    per_token = per_token + BETA * (torch.exp(delta) - delta - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def inputs(b, t, v, dtype, extra_position, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(b, t, v, device=DEVICE, generator=g) * LOGIT_STD).to(dtype)
    ids = torch.randint(0, v, (b, t), device=DEVICE, generator=g)
    with torch.no_grad():
        base = torch.empty(b, t, device=DEVICE)
        for i in range(b):  # a row block at a time: no [B, T, V] f32 temporary
            base[i] = torch.gather(logits[i, :t].float().log_softmax(-1), -1, ids[i].unsqueeze(-1)).squeeze(-1)
    old = base + LOGP_NOISE * torch.randn(b, t, device=DEVICE, generator=g)
    ref = base + LOGP_NOISE * torch.randn(b, t, device=DEVICE, generator=g)
    adv = torch.randn(b, device=DEVICE, generator=g)
    mask = (torch.rand(b, t, device=DEVICE, generator=g) > MASK_FRACTION).float()
    mask[:, 0] = 1.0
    if extra_position:
        # Liger's [B, T+1, V]: the same logits and one more position (a copy of the last), so that
        # every peer sees the same T positions and the same draws after them.
        logits = torch.cat([logits, logits[:, -1:]], dim=1)
    return logits, ids, old, ref, adv, mask


def time_peer(peer, args, dtype):
    b, t, v = args.batch, args.seq_len, args.vocab
    liger = peer == "liger"
    logits, ids, old, ref, adv, mask = inputs(b, t, v, dtype, extra_position=liger)
    if liger:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def loss_fn(x):
            loss, _ = triton_grpo_loss(x, old, ref, ids, adv, mask, temperature=1.0, beta=BETA, eps_low=EPS_LOW,
                                       eps_high=EPS_HIGH, inplace=True, loss_type="dapo", reduce=True)
            return loss
    else:
        f = torch.compile(trl_grpo) if peer == "torch-compile" else trl_grpo

        def loss_fn(x):
            return f(x, ids, old, ref, adv, mask)

    pristine = logits.clone() if liger else None  # Liger's backward overwrites the logits
    pristine_bytes = pristine.numel() * pristine.element_size() if liger else 0
    logits_bytes = logits.numel() * logits.element_size()
    work = logits.requires_grad_(True)
    times, extras, peaks, loss_value = [], [], [], None
    for i in range(args.warmup + args.steps):
        with torch.no_grad():
            if liger:
                work.copy_(pristine)
        work.grad = None
        synchronize_and_reset_peak()
        before = memory("allocated")
        timer = Timer()
        timer.start()
        loss = loss_fn(work)
        loss.backward()
        elapsed = timer.stop()
        if i >= args.warmup:
            times.append(elapsed)
            extras.append(memory("peak") - before)
            peaks.append(memory("peak") - pristine_bytes)
        loss_value = float(loss.detach())
        del loss
    return {
        "peer": peer,
        "batch": b,
        "seq_len": t,
        "vocab": v,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": len(times),
        "step_s_p50": statistics.median(times),
        "step_s_min": min(times),
        "loss": loss_value,
        "logits_bytes": logits_bytes,
        "step_extra_bytes": max(extras),
        "peak_bytes": max(peaks),
    }


def copy_gbps():
    n = (1 << 30) // 4 if DEVICE == "cuda" else (1 << 26) // 4
    src = torch.ones(n, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        timer = Timer()
        timer.start()
        dst.copy_(src)
        elapsed = timer.stop()
        if i >= 2:
            times.append(elapsed)
    return 2 * n * 4 / statistics.median(times) / 1e9


def common_arguments(p, seq_len):
    """The options of both GPU peer scripts (this one and gpu_linear_grpo.py)."""
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    p.add_argument("--peers", default="torch-eager,torch-compile,liger")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")


def run_peers(time_peer, args):
    """Each peer of `args.peers` timed by `time_peer(peer, args, dtype)` on `args.device`: one JSON
    line each, with its loss against the first peer's, or the error that stopped it."""
    global DEVICE
    DEVICE = args.device
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    first_loss = None
    for peer in args.peers.split(","):
        try:
            result = time_peer(peer, args, dtype)
            # Every peer gets the same inputs (one seed): a loss that differs from the first peer's
            # beyond rounding is a wrong result, not a faster one (Liger's Triton kernel at
            # B*T*V > 2^31 on an H100, docs/BENCHMARKS.md).
            first_loss = result["loss"] if first_loss is None else first_loss
            result["loss_rel_to_first"] = abs(result["loss"] - first_loss) / max(abs(first_loss), 1e-6)
            print(json.dumps(result), flush=True)
        except Exception as e:  # noqa: BLE001 - one peer out of memory must not hide the others
            error = {"peer": peer, "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype}
            print(json.dumps({**error, "error": repr(e)[:300]}), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(p, seq_len=4096)
    run_peers(time_peer, p.parse_args())
    print(json.dumps({"copy_gbps": copy_gbps()}), flush=True)


if __name__ == "__main__":
    main()
