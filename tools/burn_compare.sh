#!/usr/bin/env bash
# wgrad against Burn 0.22 on one adapter. Builds `tools/burn_compare` (the benchmark report's
# matmul 1024 and training steps written in Burn) and wgrad's report, then runs them in turn,
# alternating, so that both see the same machine:
#
#   bash tools/burn_compare.sh [ROUNDS]      # default 1 round
#
# Both run on Vulkan: wgrad with WGPU_BACKEND=vulkan, Burn on its first Vulkan adapter. Where
# VK_ICD_FILENAMES is unset, that is lavapipe 25.0.7 from tools/lavapipe25.sh (a machine
# without a GPU).
#
# Burn is built with its WGSL compiler (as wgrad's kernels are WGSL): with its SPIR-V compiler
# (the `spirv` feature of tools/burn_compare, Burn's `vulkan`), lavapipe 22.3 and 25.0.7 both
# crash compiling Burn's first matmul pipeline. Each Burn workload runs in a process of its own
# under `timeout $BURN_TIMEOUT` (default 600 s), so that one that does not finish on this
# adapter is reported as such and the others still run. CUBECL_AUTOTUNE_LEVEL defaults to
# `minimal`: Burn's default autotune benchmarks every candidate kernel on first use, which on
# lavapipe kept the first MLP step running past 15 minutes.
# The first build of Burn takes 20-40 minutes on two cores; it is not part of `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-1}
export WGPU_BACKEND=vulkan
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
if [ -z "${VK_ICD_FILENAMES:-}" ]; then
    eval "$(bash tools/lavapipe25.sh target/lavapipe-25)"
fi

burn=(cargo run --release --quiet --manifest-path tools/burn_compare/Cargo.toml --no-default-features --)
cargo build --release --quiet --example bench
cargo build --release --quiet --manifest-path tools/burn_compare/Cargo.toml --no-default-features

for round in $(seq "$rounds"); do
    for workload in matmul mlp128 mlp1024 cnn gpt; do
        echo "== round $round: Burn 0.22.1 $workload (CUBECL_AUTOTUNE_LEVEL=$CUBECL_AUTOTUNE_LEVEL)"
        status=0
        timeout "${BURN_TIMEOUT:-600}" "${burn[@]}" "$workload" || status=$?
        if [ "$status" = 124 ]; then
            echo "Burn $workload: did not finish in ${BURN_TIMEOUT:-600} s"
        elif [ "$status" != 0 ]; then
            echo "Burn $workload: exit status $status"
        fi
    done
    echo "== round $round: wgrad"
    cargo run --release --quiet --example bench -- --sections matmul,training
done
