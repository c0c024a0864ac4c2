"""Ours and the peers in one run, one table per (op, dtype): flashgrpo bench (fused-inplace,
fused, the candle baseline) beside PyTorch eager, torch.compile and jax.jit(value_and_grad) on the
same shape, each in its own process so that its peak RSS is its own.

Usage (through bench/compare.sh, which builds the binary and the peer venv first):
  python bench/compare.py --bin target/release/flashgrpo [--n 1024] [--vocab 151936]
         [--dtypes f32,bf16] [--ops grpo] [--steps 5] [--impls ...] [--peers ...] [--markdown OUT.md]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ours(args, op, dtype, impl):
    seq_len = 128 if args.n % 128 == 0 else args.n
    if args.hidden:
        seq_len = args.n // 4 if args.n % 4 == 0 else args.n  # B = 4, as the peers
    cmd = [args.bin, "bench", "--json", "--set", f"op={op}", "--set", f"impl={impl}", "--set", f"dtype={dtype}",
           "--set", f"batch={args.n // seq_len}", "--set", f"seq_len={seq_len}", "--set", f"vocab={args.vocab}",
           "--set", f"steps={args.steps}", "--set", "warmup=2"]
    if args.hidden:
        cmd += ["--set", f"hidden_size={args.hidden}", "--set", "warmup=1"]
    if impl == "baseline":
        cmd += ["--set", f"steps={max(2, args.steps // 2)}", "--set", "warmup=1"]
    d = run_json(cmd)
    row = {
        "name": f"flashgrpo {impl}", "p50": d["bench/step_s_p50"], "peak_rss": d["mem/peak_rss_bytes"],
        "rss_before": d["mem/rss_before_steps_bytes"], "peak_heap": d["mem/peak_bytes"], "loss": d["bench/loss"],
    }
    if args.hidden:
        # The fused-linear gradients are allocated before the steps; the baseline's within them.
        row["grads_in_steps"] = d["mem/grads_bytes"] if impl == "baseline" else 0
        row["matmul_gflops"] = d["bench/matmul_gflops"]
    else:
        row.update(floor=d["bench/floor_s"], copy_gbps=d["bench/copy_gbps"], logits_bytes=d["mem/logits_bytes"])
    return row


def peer(args, op, dtype, framework):
    cmd = [sys.executable, os.path.join(HERE, "peers", "peer_loss.py"), "--framework", framework, "--op", op,
           "--n", str(args.n), "--vocab", str(args.vocab), "--dtype", dtype, "--steps", str(args.steps)]
    if args.hidden:
        cmd += ["--hidden", str(args.hidden), "--warmup", "1"]
    d = run_json(cmd)
    # The peers allocate the gradients during the (reset-peak) steps.
    return {"name": framework, "p50": d["step_s_p50"], "peak_rss": d["peak_rss_bytes"],
            "rss_before": d["rss_before_steps_bytes"], "peak_heap": None, "loss": d["loss"],
            "grads_in_steps": d["grad_bytes"]}


def table(rows, reference, flops=None):
    mb = lambda b: f"{b / 2**20:,.0f}" if b is not None else "-"
    if flops:
        lines = ["| impl | step p50 (s) | time / ours | GFLOP/s | peak RSS in the steps (MiB) | "
                 "of which above the inputs and their gradients (MiB) |", "|---|---|---|---|---|---|"]
        for r in rows:
            above = r["peak_rss"] - r["rss_before"] - r["grads_in_steps"]
            lines.append(f"| {r['name']} | {r['p50']:.3f} | {r['p50'] / reference:.2f} | {flops / r['p50'] / 1e9:.0f} | "
                         f"{mb(r['peak_rss'])} | {mb(max(above, 0))} |")
        return "\n".join(lines)
    lines = ["| impl | step p50 (s) | time / ours | peak RSS in the steps (MiB) | of which above the inputs (MiB) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['p50']:.4f} | {r['p50'] / reference:.2f} | {mb(r['peak_rss'])} | "
                     f"{mb(r['peak_rss'] - r['rss_before'])} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--ops", default="grpo")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--impls", help="ours (default fused-inplace,fused,baseline; with --hidden fused-linear,baseline)")
    p.add_argument("--peers", help="default torch-eager,torch-compile,jax; with --hidden torch-eager,liger")
    p.add_argument("--hidden", type=int, help="fused-linear mode: GRPO from hidden states of this size and an lm_head")
    p.add_argument("--markdown", help="also write the tables to this file")
    args = p.parse_args()
    args.impls = args.impls or ("fused-linear,baseline" if args.hidden else "fused-inplace,fused,baseline")
    args.peers = args.peers if args.peers is not None else ("torch-eager,liger" if args.hidden else "torch-eager,torch-compile,jax")
    started = time.strftime("%Y-%m-%d %H:%M")
    out = [f"Run {started} on {platform.node()} ({os.cpu_count()} CPUs): N={args.n}, V={args.vocab}, "
           f"steps={args.steps} (median reported). Ours: `{os.path.basename(args.bin)} bench`; peers: "
           f"`bench/peers/peer_loss.py`."]
    for op in args.ops.split(","):
        for dtype in args.dtypes.split(","):
            rows = [ours(args, op, dtype, impl) for impl in args.impls.split(",")]
            rows += [peer(args, op, dtype, fw) for fw in args.peers.split(",") if fw]
            reference = rows[0]["p50"]
            if args.hidden:
                flops = 6.0 * args.n * args.hidden * args.vocab
                out.append(f"\n### fused-linear {op}, {dtype}, N={args.n}, H={args.hidden}, V={args.vocab}\n")
                out.append(f"Three products of 2 N H V flops each ({flops / 1e9:,.0f} GFLOP per step); this machine's "
                           f"f32 matrix product measured in the same run: {rows[0]['matmul_gflops']:.0f} GFLOP/s.\n")
                out.append(table(rows, reference, flops))
                print("\n".join(out[-3:]), flush=True)
                continue
            floor, bw, logits = rows[0]["floor"], rows[0]["copy_gbps"], rows[0]["logits_bytes"]
            out.append(f"\n### {op}, {dtype} logits ({logits / 2**20:,.0f} MiB), N={args.n}, V={args.vocab}\n")
            out.append(f"Memory floor (logits read once + gradient written once at the copy bandwidth measured "
                       f"in the same run, {bw:.1f} GB/s): {floor:.4f} s; {rows[0]['name']} is "
                       f"{reference / floor:.2f}x the floor.\n")
            out.append(table(rows, reference))
            heap = [f"{r['name']}: {r['peak_heap'] / 2**20:,.1f} MiB" for r in rows if r["peak_heap"] is not None]
            out.append("\nPeak heap above the inputs during a step (counting allocator): " + "; ".join(heap) + ".")
            print("\n".join(out[-5:]), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
