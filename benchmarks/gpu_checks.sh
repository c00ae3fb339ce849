#!/usr/bin/env bash
# The GPU checks in one run on one CUDA GPU (NCCL at world size 1), sized for a short lease (about 9 minutes on an
# H100): the planner's GPU half (predicted against measured step time and device memory, the matmul curve of
# published models' blocks), the mixture-of-experts GPU rows, the experts' grouped-matmul curve, then the GPU tests
# (the compiled ones last) with the time left. Each step has its own time limit and its own log, so that one failure
# or hang costs only its share.
#
# Usage: bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS]   (run from the repository root; SECONDS: default 540)
set -u
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS]}
total=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests"
py=${PYTHON:-python3}
start=$SECONDS

left() { echo $(( total - (SECONDS - start) )); }
# a step that hangs or overruns leaves no process behind holding the GPU for the next one; processes that held the
# GPU before the step (not ours) are left alone
gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sort; }
reap() { comm -13 <(echo "$1") <(gpu_pids) | xargs -r kill -9 2>/dev/null; }
step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    (( limit > $(left) )) && limit=$(left)
    if (( limit < 20 )); then
        echo "== $name: skipped, $(left) s left" | tee -a "$out/summary.txt"
        return
    fi
    local t0=$SECONDS before
    before=$(gpu_pids)
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    reap "$before"
    echo "== $name: exit $rc in $(( SECONDS - t0 )) s (limit $limit s)" | tee -a "$out/summary.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c "import torch, lightning, transformers; print('torch', torch.__version__, '| lightning', \
lightning.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
} >"$out/summary.txt" 2>&1
cat "$out/summary.txt"

step planner_gpu 200 "$py" benchmarks/bench_planner.py --device cuda --world 1 --precision bf16-mixed \
    --models gpt,llama --n-layer 8 --n-embd 1536 --n-head 12 --llama-intermediate 4096 --seq-len 1024 \
    --global-batch 8 --vocab-size 32000 --steps 8 --warmup 3 --rounds 1 --no-published --gemm-curve \
    --out "$out/planner_gpu.json"
step moe_gpu 120 "$py" benchmarks/bench_moe.py --device cuda --world 1 --precision bf16-mixed \
    --n-layer 4 --n-embd 1024 --n-head 16 --seq-len 1024 --batch-size 8 --n-experts 16 --top-k 2 \
    --expert-hidden 1024 --vocab-size 32000 --steps 10 --warmup 3 --rounds 2 --layout-steps 2 --gmm-repeats 5 \
    --out "$out/moe_gpu.json"
step grouped_mm 90 "$py" benchmarks/bench_grouped_mm.py --device cuda --out "$out/grouped_mm.json"
# the compiled cases last: compiling is most of their time
step test_gpu 300 "$py" -m pytest -m gpu tests/test_gpu.py -k "not compiled" -v -rs -p no:cacheprovider --durations=0
step test_gpu_compiled 300 "$py" -m pytest -m gpu tests/test_gpu.py -k compiled -v -rs -p no:cacheprovider
cat "$out/summary.txt"
