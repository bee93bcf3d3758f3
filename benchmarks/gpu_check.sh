#!/usr/bin/env bash
# The GPU check: what a machine with a GPU must show, in under 8 minutes on one GPU,
# as one table at the end (every GPU test's result, the nanoGPT step at world 1, and
# the README's two commands).
#
#     bash benchmarks/gpu_check.sh [DIR]     # logs and the table go to DIR ($OUT, or
#                                            # /tmp/gpu_check)
#
# It uses the python and torch it finds (a GPU image has its own torch; the README's
# `pip install torch==2.13.0` is the CPU build): the package is taken from this
# checkout (PYTHONPATH), so nothing is installed. Each stage has a time limit, so one
# that hangs costs its limit and the rest still run. Stages, in order of what matters:
#   cuda_tests  pytest -m cuda tests/cuda (on one GPU the ranks share it: gloo)
#   gpt         benchmarks/overhead.py --device cuda, world 1: plain / ours / DTensor,
#               eager and compiled (49M-parameter nanoGPT, B=16, T=256)
#   simulate    benchmarks/simulate.py --measure --device cuda: gt.debug.simulate_step's
#               estimate of tp.py's GPT at world 1 (data parallel, fully_shard) against
#               the measured step, on the GPU's profile
#   quickstart  README command 1's program, 4 local processes
#   suite       README command 2's tests (python -m pytest -q)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
work="$(mktemp -d)"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

"$PY" - > "$work/device.txt" 2>&1 <<'EOF'
import torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {name}")
EOF
cat "$work/device.txt"

stage() {   # stage NAME LIMIT_S COMMAND...: its log, exit status and seconds
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(( $(date +%s) - start ))" >> "$work/stages.txt"
    tail -n 3 "$work/$name.log"
}

stage cuda_tests 200 "$PY" -m pytest -m cuda tests/cuda -q -p no:cacheprovider -rA \
    --junitxml "$work/cuda.xml"
stage gpt 200 "$PY" benchmarks/overhead.py --device cuda --rows w1dp --optim foreach \
    --compile --iters 20 --json "$work/gpt.json"
stage simulate 120 "$PY" benchmarks/simulate.py --measure --device cuda --worlds 1 \
    --layouts dp,fs --dim 768 --heads 12 --layers 6 --seq 256 --vocab 8192 --rows 16 --steps 10
stage quickstart 90 "$PY" -m globaltensor.launch --nproc_per_node 4 examples/quickstart.py
stage suite 300 "$PY" -m pytest -q -x -p no:cacheprovider --junitxml "$work/suite.xml"

"$PY" benchmarks/gpu_table.py "$work" | tee "$work/table.md"
cp "$work/table.md" "$out/table.md"
tar -czf "$out/logs.tar.gz" -C "$work" .
