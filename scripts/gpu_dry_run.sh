#!/usr/bin/env bash
# The GPU machine's configure and build, here: scripts/gpu_check.sh --dry-run against the Debian
# packages it carries (.cache/debs, unpacked into a sysroot) with this machine's own copies of
# those packages hidden: it runs in a mount namespace whose /usr is an overlay without any file of
# them (whiteouts), so configure and build can use nothing a GPU machine without our packages lacks.
# Needs root (unshare, overlayfs) and the packages (scripts/gpu_debs.sh, which needs network).
#
#   scripts/gpu_dry_run.sh [--record]   the dry run: configure, build, each part's estimate
#                                       (--record writes them to cmake/gpu_check_estimates.txt)
#   scripts/gpu_dry_run.sh --without PKG [PKG...]
#                                       the negative control: the same with those packages left
#                                       out of the carried set; configure must fail, and this
#                                       script fails if it does not
# Logs and tables in build-dry/ (build-dry/control/ for the control); the build folder is
# build-dry/build (a fresh one each run, no compiler cache: the compile times are the estimates').
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
without=()
record=()
while (($#)); do
  case "$1" in
    --record) record=(--record) ;;
    --without) shift; while (($#)) && [[ $1 != --* ]]; do without+=("$1"); shift; done; continue ;;
    *) echo "usage: scripts/gpu_dry_run.sh [--record] [--without PKG...]" >&2; exit 2 ;;
  esac
  shift
done
[ "$(id -u)" = 0 ] || { echo "gpu_dry_run.sh: needs root (a mount namespace and an overlay on /usr)" >&2; exit 1; }
scripts/gpu_debs.sh > /dev/null
pkgs=$(grep -v '^#' cmake/gpu_debs.txt | tr -s ' \n' '\n' | sed '/^$/d')
# What to hide: every package the GPU machine gets from .cache/debs, and every other OpenCL
# package installed here (a copy of CL/cl.h or libOpenCL.so from any of them would hide a gap).
hide=$(printf '%s\n' $pkgs opencl-c-headers opencl-clhpp-headers ocl-icd-opencl-dev ocl-icd-libopencl1 | sort -u)

out=$root/build-dry
debs=$root/.cache/debs
sysroot=$root/.cache/sysroot
if ((${#without[@]})); then
  out=$root/build-dry/control
  debs=$out/debs
  sysroot=$out/sysroot
  rm -rf "$debs"; mkdir -p "$debs"
  for d in .cache/debs/*.deb; do
    name=$(basename "$d"); name=${name%%_*}
    printf '%s\n' "${without[@]}" | grep -qx "$name" || cp "$d" "$debs/"
  done
  echo "negative control: $(ls "$debs" | wc -l) packages carried, left out: ${without[*]}"
fi
mkdir -p "$out"
rm -rf "$out/build" "$out/overlay"
mkdir -p "$out/overlay/upper" "$out/overlay/work"
hidden=0
for p in $hide; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || continue
  while IFS= read -r f; do
    case "$f" in /usr/*) ;; *) continue ;; esac
    [ -e "$f" ] || [ -L "$f" ] || continue
    [ -d "$f" ] && [ ! -L "$f" ] && continue  # folders stay (shared with other packages); their files go
    w=$out/overlay/upper/${f#/usr/}
    mkdir -p "$(dirname "$w")"
    mknod "$w" c 0 0 2>/dev/null || true
    hidden=$((hidden + 1))
  done < <(dpkg -L "$p")
done
echo "hiding $hidden files of: $(echo $hide | tr '\n' ' ')"
t0=$(date +%s)
set +e
unshare -m bash -c '
  set -e
  mount -t overlay overlay -o "lowerdir=/usr,upperdir=$1/overlay/upper,workdir=$1/overlay/work" /usr
  for f in /usr/include/CL/cl.h /usr/lib/x86_64-linux-gnu/libOpenCL.so /usr/include/dnnl.hpp /usr/include/toml++/toml.h; do
    if [ -e "$f" ]; then echo "not hidden: $f" >&2; exit 3; fi
  done
  echo "hidden here: CL/cl.h, libOpenCL.so, dnnl.hpp, toml++ (checked)"
  export MOE_GPU_CHECK_SYSROOT=1 MOE_GPU_DEBS="$2" MOE_GPU_SYSROOT="$3" MOE_GPU_BUILD_DIR="$1/build" CCACHE_DISABLE=1
  out=$1
  shift 3
  exec scripts/gpu_check.sh --dry-run --out "$out" --budget 100000 "$@"
' dry-run "$out" "$debs" "$sysroot" "${record[@]}" 2>&1 | tee "$out/dry_run.txt"
rc=${PIPESTATUS[0]}
set -e
echo "gpu_dry_run.sh: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/dry_run.txt"
if ((${#without[@]})); then
  if [ "$rc" = 0 ]; then echo "NEGATIVE CONTROL FAILED: configure succeeded without ${without[*]}"; exit 1; fi
  grep -q "configure failed" "$out/dry_run.txt" || { echo "NEGATIVE CONTROL FAILED: it failed, but not at configure"; exit 1; }
  echo "negative control: configure failed without ${without[*]}, as it must:"
  grep -m3 -iE "OpenCL|could not find|error" "$out/gpu_check.log" || true
  exit 0
fi
exit "$rc"
