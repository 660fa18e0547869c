#!/bin/bash
# The GPU checks of ngra in one run, for a machine with a CUDA GPU, torch, numba and numba-cuda:
# the CUDA tests on CUDA tensors, GCN and GAT training on cuda against cpu, the host time per
# kernel call, and the kernel benchmark against torch's CUDA ops and PyG. Nothing needs to be
# installed: the checkout goes on PYTHONPATH. Logs, CSV and plot land in OUT (default results/gpu_check).
#
#   bash benchmarks/gpu_check.sh [OUT] [DATA_DIR]     # DATA_DIR: the datasets (../shared/datasets)
#
# The first run (H200, 2026-11-27, benchmarks/README.md "kernels_cuda.py") needed a numpy that
# its numba-cuda knows: the script stops early, with the reason, where numba.cuda cannot load.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$REPO/results/gpu_check}
DATA=${2:-$REPO/../shared/datasets}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$REPO" || exit 2
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0

"$PY" - <<'EOF' || exit 2
import sys, torch, numpy, numba
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no GPU; this script is for a GPU machine")
from kernels import _numba_cuda
reason = _numba_cuda.unusable_reason()
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, numba {numba.__version__}, "
      f"numpy {numpy.__version__}")
if reason:
    sys.exit(f"gpu_check: numba_cuda is not usable: {reason}")
EOF

echo "== CUDA tests on the GPU (log: $OUT/pytest.log)"
timeout 600 "$PY" -m pytest -q -p no:cacheprovider \
    $("$PY" -c "import xdist" 2>/dev/null && echo "-n 8") \
    tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_softmax.py \
    tests/ngra/test_engine_cuda.py tests/kernels/test_kernels_cuda_ptx.py \
    tests/benchmarks/test_bench_kernels_cuda.py tests/kernels/test_kernels_ops.py \
    tests/kernels/test_kernels_maxmin.py -k "cuda or softmax or engine" >"$OUT/pytest.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
tail -1 "$OUT/pytest.log"

echo "== training, cuda against cpu (Coauthor CS, 50 epochs)"
for model in gcn gat; do
    for device in cuda cpu; do
        timeout 300 "$PY" -m ngra train --model $model --dataset coauthor-cs --data-dir "$DATA" \
            --device $device --epochs 50 --seed 0 --no-progress 2>&1 | tail -1
    done
done

echo "== host time per kernel call, numba's launch against the direct one"
timeout 300 "$PY" benchmarks/cuda_launch.py --out "$OUT" 2>&1 | grep -v -i warn | tail -6

echo "== kernels (log: $OUT/kernels_cuda.log)"
timeout 900 "$PY" benchmarks/kernels_cuda.py --feats 16,64 --heads 1,4 --out "$OUT" \
    >"$OUT/kernels_cuda.log" 2>&1
echo "kernels_cuda exit status $?"
grep -E "^(uniform|rmat)" "$OUT/kernels_cuda.log"
