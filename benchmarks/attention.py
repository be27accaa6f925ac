"""Attention variants on this machine, one block at a time (forward + backward, fp32):

* multi-head latent attention (DeepSeek-V3's) against grouped-query attention of about the same
  parameters: tokens per CPU-second of a whole block, and the bytes an inference cache keeps per
  token and layer (GQA: a key and a value per KV head; MLA: the latent and the shared rotary key);
* a sliding window against full causal attention at long sequences: milliseconds of the attention
  call alone, forward + backward. On a CPU the window is a boolean mask beside the flash kernel, so
  it saves nothing here; on CUDA (bf16) varlen attention skips the keys outside the window.

    python benchmarks/attention.py [--dim 1024] [--seq 2048] [--long 4096,16384] [--window 1024]

Timings are medians of ``--repeats`` runs after one warm-up; CPU-seconds are this process's
(all its threads). On a GPU the block's figure is tokens per second of wall time instead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from torchpar.models.common import attention
from torchpar.models.llama import ModelArgs, TransformerBlock, rope_tables

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # (the kernels that take a window)


def _median_seconds(fn, repeats: int, clock) -> float:
    def run():
        fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    run()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        run()
        times.append(clock() - t0)
    return statistics.median(times)


def _attention_params(args: ModelArgs) -> int:
    block = TransformerBlock(args)
    return sum(p.numel() for p in block.attention.parameters())


def cache_bytes(args: ModelArgs, dtype_bytes: int = 2) -> int:
    """What an inference cache keeps per token and layer: the latent and the rotary key (MLA), or
    a key and a value per KV head (GQA)."""
    if args.latent:
        return (args.kv_lora_rank + args.rope_dim) * dtype_bytes
    return 2 * args.n_kv_heads * args.head_dim * dtype_bytes


def block_throughput(args: ModelArgs, seq: int, batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    block = TransformerBlock(args).to(DEVICE, DTYPE)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cos, sin = (t.to(DEVICE) for t in rope_tables(args))
    x = torch.randn(batch, seq, args.dim, device=DEVICE, dtype=DTYPE, requires_grad=True)

    def step():
        block(x, cos, sin).sum().backward()

    clock = time.perf_counter if DEVICE.type == "cuda" else time.process_time
    seconds = _median_seconds(step, repeats, clock)
    return {"params": _attention_params(args), "tokens_per_cpu_s": batch * seq / seconds,
            "cache_bytes": cache_bytes(args)}


def window_ms(heads: int, head_dim: int, seq: int, window: int, repeats: int) -> float:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3))

    def step():
        attention(q, k, v, window=window).sum().backward()

    return 1000 * _median_seconds(step, repeats, time.perf_counter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--long", default="4096,16384", help="sequence lengths for the window comparison")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    heads = a.dim // 64
    gqa = ModelArgs(dim=a.dim, n_layers=1, n_heads=heads, n_kv_heads=max(heads // 4, 1), max_seq_len=a.seq,
                    multiple_of=256)
    # MLA of about GQA's attention parameters: heads of 64 + a rotary 32, values 64 wide; queries from a
    # latent of dim 3/8, keys and values from one of dim 3/16
    mla = replace(gqa, n_kv_heads=heads, q_lora_rank=3 * a.dim // 8, kv_lora_rank=3 * a.dim // 16,
                  qk_rope_dim=32)
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    print(f"one block, dim {a.dim}, {heads} heads of 64, SwiGLU {gqa.ffn_hidden}, {a.batch} x {a.seq} "
          f"tokens, {str(DTYPE).removeprefix('torch.')}, {where}; forward + backward")
    rate = "tokens / s" if DEVICE.type == "cuda" else "tokens / CPU-s"
    print(f"{'attention':<40} {'attention params':>16} {rate:>15} {'cache B / token / layer':>24}")
    for name, args in ((f"GQA ({gqa.n_kv_heads} KV heads)", gqa),
                       (f"MLA (latents {mla.q_lora_rank} q, {mla.kv_lora_rank} kv)", mla)):
        r = block_throughput(args, a.seq, a.batch, a.repeats)
        print(f"{name:<40} {r['params']:>16,} {r['tokens_per_cpu_s']:>15,.0f} {r['cache_bytes']:>24,}")
    print(f"\nattention alone, {heads} heads of 64, forward + backward, ms (median of {a.repeats})")
    print(f"{'tokens':>8} {'full causal':>12} {'window ' + str(a.window):>14}")
    for seq in (int(s) for s in a.long.split(",")):
        full = window_ms(heads, 64, seq, 0, a.repeats)
        slid = window_ms(heads, 64, seq, a.window, a.repeats)
        print(f"{seq:>8} {full:>12,.0f} {slid:>14,.0f}")


if __name__ == "__main__":
    main()
