"""How flashgrpo's GRPO fwd+bwd scales: time against N (rows) and V (vocabulary), and with 1 vs 2
threads. Runs `flashgrpo bench --json` (fused-inplace, restore=false so that one logits buffer is
enough at N = 8192) and prints markdown tables. Needs only Python 3 and the release binary.

Usage: python3 bench/scaling.py [--bin target/release/flashgrpo] [--dtype f32] [--markdown OUT.md]
"""

import argparse
import json
import subprocess

NS = [256, 512, 1024, 2048, 4096, 8192]
VS = [32768, 65536, 131072, 151936, 262144]


def bench(args, n, v, threads=None, dtype=None):
    seq_len = 128 if n % 128 == 0 else n
    cmd = [args.bin, "bench", "--json", "--set", f"batch={n // seq_len}", "--set", f"seq_len={seq_len}",
           "--set", f"vocab={v}", "--set", f"dtype={dtype or args.dtype}", "--set", "impl=fused-inplace",
           "--set", "restore=false", "--set", "warmup=1", "--set", f"steps={args.steps}"]
    if threads:
        cmd += ["--set", f"threads={threads}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/flashgrpo")
    p.add_argument("--dtype", default="f32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--markdown")
    args = p.parse_args()
    out = []

    out.append(f"\n#### Time against N (V = 151936, {args.dtype}, fused-inplace, 2 threads)\n")
    out.append("| N | step p50 (s) | ns per logit | x the floor |\n|---|---|---|---|")
    for n in NS:
        d = bench(args, n, 151936)
        out.append(f"| {n} | {d['bench/step_s_p50']:.4f} | {d['bench/step_s_p50'] / (n * 151936) * 1e9:.3f} | "
                   f"{d['bench/p50_over_floor']:.2f} |")
        print(out[-1], flush=True)

    out.append(f"\n#### Time against V (N = 1024, {args.dtype}, fused-inplace, 2 threads)\n")
    out.append("| V | step p50 (s) | ns per logit | x the floor |\n|---|---|---|---|")
    for v in VS:
        d = bench(args, 1024, v)
        out.append(f"| {v} | {d['bench/step_s_p50']:.4f} | {d['bench/step_s_p50'] / (1024 * v) * 1e9:.3f} | "
                   f"{d['bench/p50_over_floor']:.2f} |")
        print(out[-1], flush=True)

    out.append("\n#### Threads (N = 1024, V = 151936, fused-inplace)\n")
    out.append("| dtype | 1 thread (s) | 2 threads (s) | speed-up |\n|---|---|---|---|")
    for dtype in ["f32", "bf16"]:
        one = bench(args, 1024, 151936, threads=1, dtype=dtype)["bench/step_s_p50"]
        two = bench(args, 1024, 151936, threads=2, dtype=dtype)["bench/step_s_p50"]
        out.append(f"| {dtype} | {one:.4f} | {two:.4f} | {one / two:.2f}x |")
        print(out[-1], flush=True)

    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
