#!/usr/bin/env bash
# tools/check_layers.py against a copy of src/: the tree as it is passes; an upward include planted
# in it fails, naming the file, the line and both folders; a folder with no place in the order
# fails, naming it; a downward include and an include of the folder itself pass.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
check="python3 $root/tools/check_layers.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cp -r "$root/src" "$work/src"
$check "$work/src" > "$work/out" 2>&1 || { cat "$work/out"; fail "src/ as it is has an upward include"; }

# Planted: core/ (the bottom) includes train/ (near the top), after its second line.
sed -i '2a #include "train/trainer.h"' "$work/src/core/tensor.h"
if $check "$work/src" > "$work/out" 2>&1; then fail "an upward include passed"; fi
grep -q '^src/core/tensor.h:3: core/ includes train/' "$work/out" || { cat "$work/out"; fail "the violation was not named"; }
[ "$(grep -c ' includes ' "$work/out")" = 1 ] || { cat "$work/out"; fail "more than the planted violation"; }
sed -i '3d' "$work/src/core/tensor.h"

# Downward and same-folder includes pass.
printf '#include "core/tensor.h"\n#include "train/metrics.h"\n' >> "$work/src/train/trainer.h"
$check "$work/src" > "$work/out" 2>&1 || { cat "$work/out"; fail "a downward include failed"; }

# A new folder must be placed in the order before anything is checked.
mkdir "$work/src/extras" && echo '#pragma once' > "$work/src/extras/x.h"
if $check "$work/src" > "$work/out" 2>&1; then fail "an unplaced folder passed"; fi
grep -q 'extras have no place in LAYERS' "$work/out" || { cat "$work/out"; fail "the unplaced folder was not named"; }
echo "check_layers: clean tree passes, planted upward include and unplaced folder fail"
