"""GPU check of long-context attention (``labkit.parallel.context``) on ``cuda:0``, and through NCCL where there
are GPUs enough.

    python3 benchmarks/gpu_check_context.py          (gpu_check.sh runs it after the pipeline's check)

1. **The blockwise kernel on the GPU**: output, LSE and gradients against ``F.scaled_dot_product_attention``
   (fp32 with TF32 off: within 1e-4; bf16: within 2e-2), and its step time beside torch's fused flash kernel
   at 4k and 16k tokens (a Python loop over tiles against a fused kernel: the ratio is the lesson's point, not a
   target).
2. **Context parallelism over NCCL**: one GPU holds one NCCL rank, so with one GPU only ``cp = 1`` runs (the
   kernel alone); with ``n >= 2`` GPUs ``torchrun --nproc_per_node=n`` trains TinyGPT with ``labkit.train --cp n``
   for each strategy.  (A side-by-side with torch's own ``context_parallel``, on DTensor, needs those GPUs too and
   is not written yet.)  Exits non-zero when a path is broken.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit.parallel.context import blockwise_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn, repeats: int = 5) -> float:
    times = []
    for index in range(repeats + 1):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if index:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def kernel_check() -> bool:
    torch.backends.cuda.matmul.allow_tf32 = False
    device, ok = torch.device("cuda:0"), True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q, k, v, grad = (torch.randn(2, 8, 1000, 64, device=device, dtype=dtype) for _ in range(4))
        mine, theirs = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
        out = blockwise_attention(*mine, block_size=128)
        expected = F.scaled_dot_product_attention(*theirs, is_causal=True)
        torch.autograd.backward(out, grad)
        torch.autograd.backward(expected, grad)
        worst = max(float((a - b).abs().max()) for a, b in
                    [(out, expected)] + [(x.grad, y.grad) for x, y in zip(mine, theirs, strict=True)])
        ok &= worst <= tolerance
        print(f"kernel {dtype}: largest difference from SDPA (out, dq, dk, dv) {worst:.2e} "
              f"({'ok' if worst <= tolerance else 'FAIL'}, tolerance {tolerance:g})")
    for seq_len in (4096, 16384):
        q, k, v, grad = (torch.randn(1, 32, seq_len, 128, device=device, dtype=torch.bfloat16) for _ in range(4))

        def run(kernel, tensors=(q, k, v), grad=grad):
            inputs = [t.clone().requires_grad_() for t in tensors]
            torch.autograd.backward(kernel(*inputs), grad)

        labkit = _timed(lambda: run(lambda *x: blockwise_attention(*x, block_size=1024)))
        fused = _timed(lambda: run(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True)))
        print(f"kernel bf16, {seq_len} tokens, 32 heads of 128, fwd + bwd: labkit {1e3 * labkit:.1f} ms, "
              f"torch's fused {1e3 * fused:.1f} ms ({labkit / fused:.1f}x)")
    return ok


def nccl_check(gpus: int) -> bool:
    if gpus < 2:
        print(f"context parallelism over NCCL: {gpus} GPU, one NCCL rank a GPU: cp > 1 needs 2 GPUs or more "
              "(the ranks' messages are checked on gloo by the test suite)")
        return True
    ok = True
    for strategy in ("ring", "all_gather", "ulysses"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m",
                   "labkit.train", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", str(gpus), "--cp-strategy",
                   strategy, "--preset", "10m", "--steps", "20", "--log-every", "10", "--precision", "bf16"]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        print(f"labkit.train --cp {gpus} --cp-strategy {strategy} over NCCL: exit {done.returncode}")
        ok &= done.returncode == 0
    return ok


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check_context.py needs a CUDA GPU")
    ok = kernel_check()
    ok &= nccl_check(torch.cuda.device_count())
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
