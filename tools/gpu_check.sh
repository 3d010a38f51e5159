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
# Where PyTorch with CUDA is installed, it ends with PyTorch's eager CNN and GPT steps on the
# same GPU and wgrad's step times as a multiple of them.
#
# A GPU machine without a Rust toolchain or network runs the binaries that tools/gpu_bundle.sh
# built elsewhere instead of building them:
#
#   GPU_CHECK_BUNDLE=target/gpu-bundle/wgrad-gpu.tar.xz bash tools/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu_check}
mkdir -p "$out"
export CARGO_TERM_COLOR=never
export WGRAD_KERNEL_FLAVOR=${WGRAD_KERNEL_FLAVOR:-gpu}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
started=$(date +%s)
elapsed() { echo "$(( $(date +%s) - started )) s"; }

# shellcheck source=tools/gpu_tests.sh
source tools/gpu_tests.sh

echo "== machine"
gpu_name=
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    gpu_name=NVIDIA
    # The adapter must be the GPU, not a software one the runtime fell back to.
    export WGRAD_EXPECT_DRIVER=${WGRAD_EXPECT_DRIVER:-$gpu_name}
fi
nproc

# Where the binaries come from: built here by cargo, or unpacked from an archive that
# tools/gpu_bundle.sh built on another machine (GPU_CHECK_BUNDLE, for a GPU machine without a
# Rust toolchain or network).
bundle=${GPU_CHECK_BUNDLE:-}
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
if [ -n "$bundle" ]; then
    if [ -f "$bundle" ]; then
        unpacked=$(mktemp -d)
        tar -xJf "$bundle" -C "$unpacked" || { echo "gpu_check: cannot unpack $bundle" >&2; exit 1; }
        bundle=$unpacked
    fi
    echo "== binaries from the bundle (commit $(cat "$bundle/commit"); checkout $(git rev-parse HEAD 2>/dev/null || echo unknown))"
    run_test() { "$bundle/bin/$1" -q "${@:2}"; }
    run_bench() { "$bundle/bin/bench" "$@"; }
    # A machine with a GPU driver but no Vulkan loader gets the bundle's.
    if ! "$ldconfig" -p 2>/dev/null | grep -q 'libvulkan\.so\.1 '; then
        export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
else
    echo "== build (release): the tests and the report ($(elapsed))"
    test_args=()
    for t in "${gpu_tests[@]}"; do test_args+=(--test "$t"); done
    if ! cargo build --release --quiet --example bench --test device "${test_args[@]}"; then
        echo "gpu_check: the build failed" >&2
        exit 1
    fi
    run_test() { cargo test --release --quiet --test "$1" -- "${@:2}"; }
    run_bench() { cargo run --release --quiet --example bench -- "$@"; }
fi
# NVIDIA's container runtime mounts its Vulkan driver under /usr/local/nvidia without
# registering it where the loader looks: point the loader at it when nothing else is named.
nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ -f "$nvidia_icd" ] &&
    ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=$nvidia_icd
fi
# ... and its libraries (libGLX_nvidia, which that file names) where the linker may not look.
for dir in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    if [ -d "$dir" ] && ! "$ldconfig" -p 2>/dev/null | grep -q "=> $dir/"; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir"
    fi
done


echo "== tests with WGRAD_KERNEL_FLAVOR=$WGRAD_KERNEL_FLAVOR ($(elapsed))"
failed=0
if run_test device info_names --nocapture >"$out/test-device.log" 2>&1; then
    grep 'adapter:' "$out/test-device.log"
else
    failed=$((failed + 1))
    echo "FAILED the adapter check (log: $out/test-device.log)"
    grep -E 'adapter:|expected|panicked|Error' "$out/test-device.log" | head -5
    if [ -n "$gpu_name" ]; then
        # On a machine with a GPU the rest would only time a software adapter: stop here and
        # say what the Vulkan loader could see, so that the next run can be fixed first.
        echo "== why no $gpu_name adapter: the Vulkan loader and drivers this machine has"
        "$ldconfig" -p 2>/dev/null | grep -E 'libvulkan|libGLX_nvidia|libEGL_nvidia' | head -5
        ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/nvidia/share/vulkan/icd.d 2>&1 | head -12
        echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-} VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        echo "== done in $(elapsed): stopped at the adapter check"
        exit 1
    fi
fi
for t in "${gpu_tests[@]}"; do
    if run_test "$t" >"$out/test-$t.log" 2>&1; then
        echo "ok     $t ($(grep -h 'test result' "$out/test-$t.log" | tail -1))"
    else
        failed=$((failed + 1))
        echo "FAILED $t (log: $out/test-$t.log)"
        grep -E '^(---- |thread .* panicked)' "$out/test-$t.log" | head -10
    fi
done

echo "== benchmark report ($(elapsed))"
# shellcheck disable=SC2086
run_bench --json ${GPU_CHECK_BENCH_FLAGS:-} \
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
echo "== PyTorch eager on this machine's GPU, the same CNN and GPT steps ($(elapsed))"
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if python3 tools/pytorch_baselines.py steps --device cuda >"$out/pytorch.txt" 2>&1; then
        cat "$out/pytorch.txt"
        # wgrad's step time over PyTorch's, for each of the two (issue 27's bar: the GPT within 2x).
        python3 - "$out/bench.json" "$out/pytorch.txt" <<'PY' || true
import json, re, sys
rows = {row["name"]: row["value"] for row in json.load(open(sys.argv[1]))["rows"]}
torch_ms = dict(re.findall(r"^(cnn|gpt) step.*: ([0-9.]+) ms$", open(sys.argv[2]).read(), re.M))
models = {"cnn": "CNN (2 conv + 2 linear), batch 64, AdamW", "gpt": "GPT 4x128, block 64, batch 12, AdamW"}
for key, name in models.items():
    for how in ("eager", "captured"):
        ours = rows.get(f"{name} {how}")
        if ours and key in torch_ms:
            print(f"{key} {how}: wgrad {ours:.2f} ms, PyTorch eager {float(torch_ms[key]):.2f} ms: {ours / float(torch_ms[key]):.2f}x")
PY
    else
        echo "PyTorch's steps failed (log: $out/pytorch.txt)"
        tail -5 "$out/pytorch.txt"
    fi
else
    echo "n/a: no PyTorch with CUDA here"
fi
echo "== done in $(elapsed): $failed failed"
exit $((failed > 0))
