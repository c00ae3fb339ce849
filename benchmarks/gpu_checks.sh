#!/usr/bin/env bash
# The GPU checks in one run on one CUDA GPU (NCCL at world size 1), sized for a short lease (about 9 minutes on an
# H100). Each step has its own time limit and its own log, so that one failure or hang costs only its share; steps
# run in the order given (default: all, most important first):
#   cp          the context-parallel fused kernels' exactness (tests/test_gpu.py -k cp) and their speed at 32k
#               tokens against one fused SDPA call, per kernel (benchmarks/bench_cp_kernels.py)
#   cpworld     the context-parallel engine at world 1 against SDPA (benchmarks/bench_context.py --world 1)
#   titan       lightning_par against torchtitan's Llama 3 code on the same model (benchmarks/bench_vs_torchtitan.py;
#               its wheels travel in .whl/ and are installed by the caller, see docs/benchmarks.md)
#   fsdp        FSDP2Strategy against a hand-written loop, compiled (bf16 and float8) and eager (benchmarks/bench_gpu.py)
#   tests       the rest of tests/test_gpu.py, the compiled cases last
#   planner     the planner's GPU half, the MoE GPU rows, the experts' grouped-matmul curve
#
# Usage: bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS] [STEP ...]   (from the repository root; SECONDS: 540)
set -u
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS] [STEP ...]}
total=${2:-540}
shift $(( $# > 1 ? 2 : 1 ))
steps=${*:-cp titan fsdp tests planner cpworld}
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
lightning.__version__, '| transformers', transformers.__version__, '| cuDNN', torch.backends.cudnn.version(), '|', \
torch.cuda.get_device_name())"
} >"$out/summary.txt" 2>&1
cat "$out/summary.txt"

run_cp() {
    # its own limit: the fixture runs every case on every fused kernel (cuDNN, flash, memory-efficient) first
    step test_gpu_cp 150 "$py" -m pytest -m gpu tests/test_gpu.py -k "cp_ or context_parallel" -v -rs \
        -p no:cacheprovider --durations=0
    # per kernel (what SDPA picks, cuDNN, flash) for the unsplit call and the blocks alike; the GPU time by kernel
    step cp_kernels 90 "$py" benchmarks/bench_cp_kernels.py --repeats 3 --cps 2 8 --kernels auto cudnn flash \
        --math-seq 4096 --profile --out "$out/cp_kernels.json"
}
run_cpworld() {
    # our attention engine at world 1 (ring, all-gather, Ulysses blocks) against one fused SDPA call at 32k tokens
    step context_world1 60 "$py" benchmarks/bench_context.py --device cuda --world 1 --seq 32768 --iters 3 \
        --out "$out/context_world1.json"
}
run_titan() {
    # 6 of Llama-3.1-8B's layers: what an 80 GB H100 holds with AdamW at seq 2,048 x 2 (the same on an H200);
    # compiled bf16 and float8 first (the float8 goal), then eager, then seq 8,192 with full activation checkpointing
    # 20 timed steps a side: six (2026-11-28) did not separate a 1-2 % difference from noise
    step vs_torchtitan 250 "$py" benchmarks/bench_vs_torchtitan.py --budget-s 215 --layers 6 --steps 20 \
        --rows ${TITAN_ROWS:-1,2,0,3} \
        --out "$out/vs_torchtitan.json"
}
run_fsdp() {
    step fsdp_gpu 200 "$py" benchmarks/bench_gpu.py \
        --variants hand_compiled,fsdp2_compiled,hand_compiled_float8,fsdp2_compiled_float8,hand,fsdp2 \
        --steps 10 --warmup 6 --out "$out/fsdp_gpu.json"
}
run_tests() {
    step test_gpu 300 "$py" -m pytest -m gpu tests/test_gpu.py -k "not compiled and not cp_ and not context_parallel" \
        -v -rs -p no:cacheprovider --durations=0
    step test_gpu_compiled 300 "$py" -m pytest -m gpu tests/test_gpu.py -k compiled -v -rs -p no:cacheprovider
}
run_planner() {
    step planner_gpu 200 "$py" benchmarks/bench_planner.py --device cuda --world 1 --precision bf16-mixed \
        --models gpt,llama --n-layer 8 --n-embd 1536 --n-head 12 --llama-intermediate 4096 --seq-len 1024 \
        --global-batch 8 --vocab-size 32000 --steps 8 --warmup 3 --rounds 1 --no-published --gemm-curve \
        --out "$out/planner_gpu.json"
    step moe_gpu 120 "$py" benchmarks/bench_moe.py --device cuda --world 1 --precision bf16-mixed \
        --n-layer 4 --n-embd 1024 --n-head 16 --seq-len 1024 --batch-size 8 --n-experts 16 --top-k 2 \
        --expert-hidden 1024 --vocab-size 32000 --steps 10 --warmup 3 --rounds 2 --layout-steps 2 --gmm-repeats 5 \
        --out "$out/moe_gpu.json"
    step grouped_mm 90 "$py" benchmarks/bench_grouped_mm.py --device cuda --out "$out/grouped_mm.json"
}
for name in $steps; do
    case $name in
        cp|cpworld|titan|fsdp|tests|planner) "run_$name" ;;
        *) echo "unknown step $name (cp cpworld titan fsdp tests planner)" | tee -a "$out/summary.txt" ;;
    esac
done
cat "$out/summary.txt"
