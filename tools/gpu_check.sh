#!/usr/bin/env bash
# One prepared run for a machine with a GPU, at most 8 minutes: builds in release, runs the
# tests of every op that has a GPU kernel with the GPU kernels forced (WGRAD_KERNEL_FLAVOR=gpu,
# which a real GPU picks by itself), on the adapter Device::new() picks, then the benchmark
# report (`examples/bench.rs`), and prints what is needed to judge the GPU path: the adapter,
# the driver, each test binary's result, the report as markdown (and JSON in OUT_DIR).
#
#   bash tools/gpu_check.sh [OUT_DIR]        # default target/gpu_check
#
# On a software adapter it runs the same way (the GPU kernels on lavapipe), so that the first
# run on a GPU is not its first run at all. Extra report flags: GPU_CHECK_BENCH_FLAGS="--full".
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu_check}
mkdir -p "$out"
export CARGO_TERM_COLOR=never
export WGRAD_KERNEL_FLAVOR=${WGRAD_KERNEL_FLAVOR:-gpu}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
started=$(date +%s)
elapsed() { echo "$(( $(date +%s) - started )) s"; }

# The test binaries of ops with a GPU kernel: matmul, attention, reductions, softmax,
# cross-entropy, norms, convolutions, casts, the CPU-against-GPU flavour checks, and the F16
# read paths (WGSL f16 bindings must read subnormals as the packed words do on this adapter).
tests=(matmul attention attention_options attention_memory reduce softmax_index cross_entropy
       nn conv_pool rotary flavours large_tensors dtypes f16_reads gradcheck)
test_args=()
for t in "${tests[@]}"; do test_args+=(--test "$t"); done

echo "== machine"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
nproc
echo "== build (release): the tests and the report ($(elapsed))"
if ! cargo build --release --quiet --example bench --test device "${test_args[@]}"; then
    echo "gpu_check: the build failed" >&2
    exit 1
fi

echo "== tests with WGRAD_KERNEL_FLAVOR=$WGRAD_KERNEL_FLAVOR ($(elapsed))"
cargo test --release --quiet --test device info_names -- --nocapture 2>&1 | grep 'adapter:'
failed=0
for t in "${tests[@]}"; do
    if cargo test --release --quiet --test "$t" >"$out/test-$t.log" 2>&1; then
        echo "ok     $t ($(grep -h 'test result' "$out/test-$t.log" | tail -1))"
    else
        failed=$((failed + 1))
        echo "FAILED $t (log: $out/test-$t.log)"
        grep -E '^(---- |thread .* panicked)' "$out/test-$t.log" | head -10
    fi
done

echo "== benchmark report ($(elapsed))"
# shellcheck disable=SC2086
cargo run --release --quiet --example bench -- --json ${GPU_CHECK_BENCH_FLAGS:-} \
    >"$out/bench.json" 2>"$out/bench.log" || { echo "gpu_check: the report failed" >&2; tail "$out/bench.log"; failed=$((failed + 1)); }
if [ -s "$out/bench.json" ]; then
    # The same report as markdown, from the JSON (no second run).
    python3 - "$out/bench.json" <<'PY' || cat "$out/bench.json"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"## {r['adapter']} ({r['backend']}, {r['device_type']})\n")
print(f"Driver: {r['driver']}. {r['limits']}. Peak: {r['peak']}.\n")
print("| section | bench | value | unit | note |\n|---|---|---|---|---|")
for row in r["rows"]:
    v = "n/a" if row["value"] is None else f"{row['value']:.4g}"
    print(f"| {row['section']} | {row['name']} | {v} | {row['unit']} | {row['note']} |")
PY
fi
echo "== done in $(elapsed): $failed failed"
exit $((failed > 0))
