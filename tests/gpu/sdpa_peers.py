#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on its flash and cuDNN backends: the
peers of the fast-mode prefill attention kernels (bench_cuda_ops --only
prefill-attn). Causal, batch 1, 32 query heads over 8 kv heads (K and V
expanded to 32 heads: the same FLOPs), head dim 128, bf16, n = n_kv = 2048,
4096, 16384; TFLOP/s count the causal half (4 flops per (query, key) pair and
dim over n (n + 1) / 2 pairs), as bench_cuda_ops does. Median of CUDA-event
timed runs after a warm-up. Prints one line per (backend, n)."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    H, Hkv, hd = 32, 8, 128
    print("torch", torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    for n in (2048, 4096, 16384):
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(1, H, n, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, Hkv, n, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, Hkv, n, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        k = k.repeat_interleave(H // Hkv, dim=1).contiguous()
        v = v.repeat_interleave(H // Hkv, dim=1).contiguous()
        flops = 4.0 * n * (n + 1) / 2 * hd * H
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    sec = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                print(f"sdpa {name:5s} n={n:<6d} heads {H}/{Hkv} hd {hd} causal  {sec * 1e3:8.3f} ms  "
                      f"{flops / sec / 1e12:7.1f} TFLOP/s", flush=True)
            except Exception as e:  # a backend that refuses the shape
                print(f"sdpa {name:5s} n={n:<6d}: not run ({type(e).__name__}: {str(e)[:120]})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
