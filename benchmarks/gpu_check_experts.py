"""GPU check of the mixture-of-experts layer and expert parallelism (``labkit.parallel.experts``) on ``cuda:0``, and
through NCCL where there are GPUs enough.

    python3 benchmarks/gpu_check_experts.py          (gpu_check.sh runs it after the long-context check)

1. **The layer on the GPU**: output and every gradient against its definition (``moe_reference``, every expert on
   every token) in fp32 (TF32 off: within 1e-4) and bf16 (within 5e-2), with a capacity that drops choices; its
   forward and backward time beside a dense MLP of the same active FLOPs and beside every expert on every token.
2. **Expert parallelism over NCCL**: one GPU holds one NCCL rank, so with one GPU ``labkit.train --experts 8``
   runs at ``ep = 1`` (the layer through the trainer, bf16); with ``n >= 2`` GPUs ``torchrun
   --nproc_per_node=n`` trains with ``--ep n``, the all-to-alls on NCCL.  Exits non-zero when a path is broken.
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
from torch import nn  # noqa: E402

from labkit.parallel.experts import MoE, moe_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def layer_check() -> bool:
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        torch.manual_seed(0)
        layer = MoE(512, 8, 2, expert_hidden=1024, capacity_factor=1.0).to("cuda", dtype)
        x = torch.randn(4096, 512, device="cuda", dtype=dtype)
        grads = []
        for forward in (layer, lambda t, layer=layer: moe_reference(layer, t)):
            layer.zero_grad()
            inputs = x.clone().requires_grad_()
            out = forward(inputs)
            out.float().pow(2).mean().backward()
            grads.append([out.detach().float(), inputs.grad.float()]
                         + [p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                            for p in layer.parameters()])
        error = max(float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(*grads, strict=True))
        fine = error <= tolerance
        ok &= fine
        print(f"{'ok ' if fine else 'BAD'} MoE layer on cuda, {str(dtype)[6:]}: largest relative error against the "
              f"definition {error:.2e} (bound {tolerance:g}); dropped {layer.last['dropped']} of 8192 choices")
    torch.manual_seed(0)
    layer = MoE(1024, 8, 2, expert_hidden=4096).to("cuda", torch.bfloat16)
    dense = nn.Sequential(nn.Linear(1024, 8192), nn.GELU(), nn.Linear(8192, 1024)).to("cuda", torch.bfloat16)
    x = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times = {name: _timed(lambda f=f: f(x).sum().backward())
             for name, f in (("labkit MoE", layer), ("dense MLP, same active FLOPs", dense),
                             ("every expert on every token", lambda t: moe_reference(layer, t)))}
    for name, seconds in times.items():
        print(f"    {name:>30}: {1e3 * seconds:7.2f} ms fwd + bwd (16k tokens x 1024, 8 experts of 4096, top-2, bf16)")
    return ok


def ep_check() -> bool:
    gpus = torch.cuda.device_count()
    ep = gpus if gpus in (2, 4, 8) else 1
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ep}", "-m",
               "labkit.train", f"--dp={ep}", "--tp=1", "--pp=1", f"--ep={ep}", "--experts=8", "--top-k=2",
               "--capacity-factor=1.25", "--aux-loss-weight=0.01", "--preset=10m", "--steps=20", "--log-every=10",
               "--batch-size=8", "--precision=bf16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "4"}
    done = subprocess.run(command, env=env, cwd=ROOT, timeout=240)
    print(f"{'ok ' if done.returncode == 0 else 'BAD'} labkit.train --experts 8 --ep {ep} on {ep} GPU(s), NCCL, bf16")
    return done.returncode == 0


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        raise SystemExit(0)
    ok = layer_check()
    ok &= ep_check()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
