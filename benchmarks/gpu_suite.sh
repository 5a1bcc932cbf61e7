#!/usr/bin/env bash
# The GPU figures in one run: the fused log-prob head, the sampler against the HBM roofline,
# the NF4 kernel, and a GRPO run's CPU/GPU parity. Every figure goes to a file in OUT_DIR.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [SECONDS]
#
# Run from the repository root on a machine with one NVIDIA GPU, in a Python that has JAX with
# CUDA (and flax, optax, orbax, ...). Python packages that Python lacks may lie as wheels in
# .whl/ (installed into /tmp/site, nothing else is touched); tunelib itself is copied to
# /tmp/tunelib-src/tunelib with the kernels folder in its place, as a wheel lays it out. The
# CPU half of the parity check is .gpu/grpo_cpu.npz, made beforehand on a CPU machine with
#   python benchmarks/grpo_parity.py --out .gpu/grpo_cpu.npz
# Parts run in order of importance, each with a time limit inside SECONDS (default 500) in
# all; a part that fails or runs out of time is logged and the next one starts. PARTS (names,
# space-separated) runs only those parts; PART_LIMIT (seconds) replaces each part's own limit.
set -uo pipefail
out=$(realpath -m "${1:?usage: bash benchmarks/gpu_suite.sh OUT_DIR [SECONDS]}")
budget=${2:-500}
repo=$(pwd)
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3
fi
rm -rf /tmp/tunelib-src && mkdir -p /tmp/tunelib-src
cp -r tunelib /tmp/tunelib-src/ && cp kernels/*.py /tmp/tunelib-src/tunelib/kernels/
export PYTHONPATH=/tmp/tunelib-src:/tmp/site
# The scripts run from elsewhere: in the root, `python -c` would import the source tree's
# tunelib/ (without the kernels' modules) before the copy.
mkdir -p /tmp/suite-run && cd /tmp/suite-run || exit 1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, jax, jaxlib, flax, optax; print(sys.version.split()[0], 'jax', \
jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', \
optax.__version__, jax.devices())"
    python3 -c "import tunelib, tunelib.kernels, tunelib.peft; print('tunelib imports')"
} 2>&1 | tee -a "$log"

# part NAME LIMIT COMMAND...: run it, at most LIMIT seconds and never past the budget.
part() {
    local name=$1 limit=$2
    shift 2
    [[ -n "${PARTS:-}" && " $PARTS " != *" $name "* ]] && return
    local left=$((budget - SECONDS - 5))
    if ((left < 20)); then
        echo "== $name: skipped, $left s of the budget left" | tee -a "$log"
        return
    fi
    ((limit > left)) && limit=$left
    [[ -n "${PART_LIMIT:-}" ]] && limit=$((PART_LIMIT < left ? PART_LIMIT : left))
    echo "== $name (limit $limit s, at $SECONDS s)" | tee -a "$log"
    timeout --signal=KILL "$limit" "$@" 2>&1 | tail -60 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]} at $SECONDS s" | tee -a "$log"
}

bench="$repo/benchmarks"
part logprobs-gemma2 150 python3 "$bench/logprobs.py" --size gemma2-2b \
    --json-out "$out/logprobs_gemma2.json"
part sampler 170 python3 "$bench/sampler_roofline.py" --json-out "$out/sampler.json"
part nf4 150 python3 "$bench/nf4_matmul.py" --json-out "$out/nf4.json"

cpu="$repo/.gpu/grpo_cpu.npz"
parity() {  # parity LABEL FLAGS...: a GPU run, then its comparison with the CPU run
    local label=$1
    shift
    python3 "$bench/grpo_parity.py" --out "/tmp/suite-run/$label.npz" "$@" | tail -1 &&
        python3 "$bench/grpo_parity.py" --compare "$cpu" "/tmp/suite-run/$label.npz" \
            --json-out "/tmp/suite-run/$label.json" | tail -4 &&
        cat "/tmp/suite-run/$label.json" >>"$out/parity.jsonl"
}
export -f parity
export bench cpu out
part parity-free 60 bash -c 'parity gpu_free'
part parity-replay-highest 60 bash -c \
    'parity gpu_replay_highest --replay "$cpu" --matmul-precision highest'
part sampler-unrolled 120 python3 "$bench/sampler_roofline.py" --unrolled --batches 1,8 \
    --json-out "$out/sampler_unrolled.json"
part sampler-stacked-1-8-32 100 python3 "$bench/sampler_roofline.py" --batches 1,8,32 \
    --json-out "$out/sampler_stacked.json"
part sampler-per-layer 330 python3 "$bench/sampler_roofline.py" --layout per_layer \
    --batches 1,8,32 --json-out "$out/sampler_per_layer.json"
part windowed-cache 330 python3 "$bench/windowed_cache.py" --size gemma3-1b --repeats 2 \
    --json-out "$out/windowed_cache.json"
part layer-groups 240 python3 "$bench/gemma4_layer_groups.py" --repeats 2 \
    --json-out "$out/layer_groups.json"
part logprobs-llama3 220 python3 "$bench/logprobs.py" --size llama3-8b --n 8192 \
    --json-out "$out/logprobs_llama3.json"
part parity-replay 60 bash -c 'parity gpu_replay --replay "$cpu"'
echo "suite done at $SECONDS s" | tee -a "$log"
