#!/usr/bin/env bash
# Runs on a machine with a CUDA GPU whose python3 already has torch (the device machine's image does).
# Usage: bash benchmarks/gpu_check.sh   — prints the NCCL path check, the fp32/bf16/fp16 step-time table and the
# tensor-parallel check (labkit.parallel.tensor on cuda:0 through NCCL at tp=1: operators, layers, wrapper, dropout)
# and the pipeline runtime's check (labkit.parallel.pipeline on cuda:0, p=1: GPipe, 1F1B, ZB-H1's split backward),
# then long-context attention (the blockwise kernel against torch's fused one; cp > 1 through NCCL where there are
# GPUs enough), the MoE layer against its definition and labkit.train --experts (--ep n through NCCL on n GPUs),
# then the 3D trainer on cuda:0 through NCCL (one GPU: dp=tp=pp=1, every wrapper of parallelize, bf16, a trace).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
PYTHONPATH="$PWD" "$PYTHON" -m labkit.cli doctor
status=0
PYTHONPATH="$PWD" timeout 480 "$PYTHON" benchmarks/gpu_check.py || status=$?
PYTHONPATH="$PWD" timeout 120 "$PYTHON" benchmarks/gpu_check_pipeline.py || status=$?
PYTHONPATH="$PWD" timeout 300 "$PYTHON" benchmarks/gpu_check_context.py || status=$?
PYTHONPATH="$PWD" timeout 300 "$PYTHON" benchmarks/gpu_check_experts.py || status=$?
for zero in 0 1 2 3; do  # one GPU cannot hold several NCCL ranks: the 3D path at degree 1, on cuda, each wrapper
    PYTHONPATH="$PWD" OMP_NUM_THREADS=4 timeout 120 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 \
        -m labkit.train --dp 1 --tp 1 --pp 1 --zero "$zero" --preset 10m --steps 20 --log-every 10 \
        --batch-size 8 --precision bf16 --trace "/tmp/labkit-3d-zero$zero.json" || status=$?
done
exit $status
