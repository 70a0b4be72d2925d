#!/usr/bin/env bash
# GPU check for hvd_sgp's CUDA and NCCL paths, in under 5 minutes on one GPU machine:
#   bash scripts/gpu_check.sh            (from the repository root, in an environment where
#                                         `pip install ".[all]"` and a CUDA build of torch are)
# 2 ranks, each its own SGP node, sharing the GPUs (CUDA staging through pinned memory); then,
# with 2 or more GPUs, 2 ranks forming one node (NCCL in-node gradient averaging); then a
# fault-tolerant run on CUDA parameters that loses a rank and spawns its replacement.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python=${PYTHON:-python}
mpirun=$(dirname "$(command -v "$python")")/mpirun
[ -x "$mpirun" ] || mpirun=mpirun
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus; $("$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)")"
timeout 150 "$mpirun" -np 2 --oversubscribe --bind-to none -x HVD_SGP_LOCAL_SIZE=1 \
    "$python" scripts/gpu_check.py
if [ "$gpus" -ge 2 ]; then
    timeout 150 "$mpirun" -np 2 --bind-to none -x HVD_SGP_LOCAL_SIZE=2 "$python" scripts/gpu_check.py
else
    echo "one GPU: the NCCL in-node path needs two (NCCL refuses two ranks on one GPU); skipped"
fi
# Fault tolerance on the GPU: 3 single-rank nodes sharing the GPUs, rank 2 SIGKILLed at step
# 40; the survivors repair the world, spawn a replacement (--max-np 3) that builds its model on
# CUDA, hand it their state, and finish on 3 ranks.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout 200 "$python" -m hvd_sgp.runner.launch --mpi-launcher "$mpirun" -np 3 --max-np 3 \
    --local-size 1 --fault-tolerant "$python" examples/elastic_digits.py --epochs 3 \
    --kill-rank 2 --kill-step 40 --kill-how sigkill >"$log" 2>&1 || { cat "$log"; exit 1; }
grep -E "dies|lost rank|final test accuracy|sgprun:" "$log"
grep -q "final test accuracy .* on 3 ranks" "$log" || { cat "$log"; exit 1; }
echo "ok a SIGKILLed rank on CUDA parameters replaced by a spawned one; 3 ranks finished"
