#!/usr/bin/env bash
# Fetches Mesa 25.0.7's lavapipe (Vulkan on the CPU) from Debian's bookworm-backports into a
# directory of its own, without touching the system's Mesa, and prints the environment that
# selects it:
#
#   eval "$(bash tools/lavapipe25.sh)"      # then: WGPU_BACKEND=vulkan cargo test
#
# Mesa 25 has no 65,535-iteration loop limit and runs wgrad's kernels 1.5-3x faster than
# Debian 12's Mesa 22.3 (BENCHMARKS.md); Ubuntu 24.04 and newer distributions ship Mesa 24-25
# already. Needs apt-get and dpkg (Debian or Ubuntu on x86_64) and network access; not root.
# The first argument is the directory (default: target/lavapipe-25); a second run reuses it.
set -euo pipefail

dir="$(mkdir -p "${1:-target/lavapipe-25}" && cd "${1:-target/lavapipe-25}" && pwd)"
lib="$dir/root/usr/lib/x86_64-linux-gnu"
icd="$dir/lvp_icd.json"

if [ ! -f "$lib/libvulkan_lvp.so" ]; then
    mkdir -p "$dir/sources" "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/debs"
    cat > "$dir/sources/backports.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    apt_private=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$dir/sources"
                 -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache"
                 -o APT::Sandbox::User=root -qq)
    apt-get "${apt_private[@]}" update >&2
    (cd "$dir/debs" && apt-get "${apt_private[@]}" download -t bookworm-backports \
        mesa-vulkan-drivers libdrm2 libdrm-amdgpu1 >&2)
    for deb in "$dir"/debs/*.deb; do
        dpkg -x "$deb" "$dir/root"
    done
fi
[ -f "$lib/libvulkan_lvp.so" ] || { echo "lavapipe25: no libvulkan_lvp.so in $lib" >&2; exit 1; }

# The package's ICD names the library by file name alone: point it at this copy.
cat > "$icd" <<JSON
{
    "ICD": { "api_version": "1.4.305", "library_path": "$lib/libvulkan_lvp.so" },
    "file_format_version": "1.0.0"
}
JSON
# Its libdrm (newer than bookworm's) is found beside it.
echo "export VK_ICD_FILENAMES='$icd'"
echo "export LD_LIBRARY_PATH='$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}'"
