#!/usr/bin/env bash
# Builds what tools/gpu_check.sh runs, here, into one archive for a GPU machine that has no Rust
# toolchain and no network (a rented box, a CI runner with a GPU, a locked-down lab machine):
# the release test binaries of the ops with a GPU kernel, the benchmark report, and the Vulkan
# loader (libvulkan.so.1), for the case where that machine has a driver but no loader.
#
#   bash tools/gpu_bundle.sh [ARCHIVE]     # default target/gpu-bundle/wgrad-gpu.tar.xz
#
# Then, on the GPU machine, in a checkout of the same commit:
#
#   GPU_CHECK_BUNDLE=target/gpu-bundle/wgrad-gpu.tar.xz bash tools/gpu_check.sh [OUT_DIR]
#
# The binaries are x86-64 Linux built against this machine's glibc: build the archive on an
# x86-64 machine whose glibc is no newer than the GPU machine's. They are stripped and packed
# with xz (about 20 MiB for 17 binaries of about 7 MiB each, which share most of their code).
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:-target/gpu-bundle/wgrad-gpu.tar.xz}
# shellcheck source=tools/gpu_tests.sh
source tools/gpu_tests.sh

test_args=()
for t in "${gpu_tests[@]}" device; do test_args+=(--test "$t"); done
echo "gpu_bundle: building ${#gpu_tests[@]} test binaries, the device check and the report (release)" >&2
# Cargo names each executable it builds in its JSON messages; the last one per target wins.
executables=$(cargo build --release --example bench "${test_args[@]}" --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
found = {}
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        found[message["target"]["name"]] = message["executable"]
for name, path in sorted(found.items()):
    print(name, path)
')

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin" "$staging/lib"
while read -r name path; do
    cp "$path" "$staging/bin/$name"
    strip -s "$staging/bin/$name"
done <<<"$executables"
for t in "${gpu_tests[@]}" device bench; do
    [ -x "$staging/bin/$t" ] || { echo "gpu_bundle: cargo built no binary for $t" >&2; exit 1; }
done
loader=$(ldconfig -p | awk '/libvulkan\.so\.1 .*x86-64/ {print $NF; exit}')
if [ -n "$loader" ]; then
    cp -L "$loader" "$staging/lib/libvulkan.so.1"
else
    echo "gpu_bundle: no libvulkan.so.1 here (apt-get install libvulkan1); the archive has no loader" >&2
fi
git rev-parse HEAD >"$staging/commit"

mkdir -p "$(dirname "$archive")"
tar -C "$staging" -cf - . | xz -9 -T0 >"$archive"
echo "gpu_bundle: $archive ($(du -h "$archive" | cut -f1), commit $(cut -c1-12 "$staging/commit"))" >&2
