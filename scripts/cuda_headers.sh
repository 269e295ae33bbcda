#!/usr/bin/env bash
# The header-only CUDA libraries (CUTLASS, cuDNN frontend) into .cache/cuda-headers/, from the
# wheels pinned with their hashes in cmake/cuda_headers.txt. Idempotent. Offline (a GPU machine
# without network): pass the folder holding the two wheels as $1, e.g. .cache/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.cache/cuda-headers
wheels=${1:-.cache/wheels}
stamp=$out/.stamp
want=$(sha256sum cmake/cuda_headers.txt | cut -c1-64)
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
mkdir -p "$wheels"
if ! ls "$wheels"/nvidia_cutlass-4.2.0.0-*.whl "$wheels"/nvidia_cudnn_frontend-1.32.0-*.whl >/dev/null 2>&1; then
  python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -r cmake/cuda_headers.txt -d "$wheels"
fi
# Hashes are checked here too, so wheels carried to a machine without network are checked as well.
while read -r spec hash; do
  case "$spec" in ''|'#'*) continue ;; esac
  name=${spec%%==*}; version=${spec##*==}
  file=$(ls "$wheels"/"${name//-/_}"-"$version"-*.whl)
  echo "${hash#--hash=sha256:}  $file" | sha256sum --check --quiet
done < cmake/cuda_headers.txt
rm -rf "$out" && mkdir -p "$out"
python3 - "$wheels" "$out" <<'PY'
import pathlib, sys, zipfile
wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
keep = {  # prefix in the wheel -> folder under out
    "cutlass_library/source/include/": "cutlass/include/",
    "cutlass_library/source/tools/util/include/": "cutlass/util/include/",
    "include/": "cudnn_frontend/include/",
}
for whl in sorted(wheels.glob("nvidia_cu*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            for src, dst in keep.items():
                if info.filename.startswith(src) and not info.is_dir():
                    target = out / dst / info.filename[len(src):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(info))
PY
echo "$want" > "$stamp"
