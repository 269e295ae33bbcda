#!/usr/bin/env python3
"""The CUDA kernels' register and shared-memory use, from ptxas's report of the build.

Reads every <object>.ptxas that cmake/nvcc_resources.sh kept in BUILD_DIR, prints one row per
kernel and architecture (registers, shared memory, stack, spills) and fails when
  - a kernel spills registers (spill stores or loads > 0 bytes), or
  - the kernels compiled differ from the committed list (src/kernels/cuda/kernels.txt):
    a new kernel must be added there, a removed one deleted.
Usage: tools/check_kernels.py BUILD_DIR [--write]   (--write rewrites the list from the build)
"""
import pathlib
import re
import subprocess
import sys

LIST = pathlib.Path(__file__).resolve().parent.parent / "src/kernels/cuda/kernels.txt"


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def parse(path):
    rows, entry = [], None
    for line in path.read_text().splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            entry = {"mangled": m.group(1), "arch": m.group(2), "regs": 0, "smem": 0, "stack": 0, "spill": 0}
            rows.append(entry)
            continue
        if entry is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            entry["stack"], entry["spill"] = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entry["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            entry["smem"] = int(s.group(1)) if s else 0
    return rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = pathlib.Path(sys.argv[1])
    reports = sorted(build.rglob("*.ptxas"))
    if not reports:
        sys.exit(f"check_kernels: no ptxas reports under {build} (build with -DMOE_CUDA=ON first)")
    rows = []
    for p in reports:
        for r in parse(p):
            r["source"] = p.name.split(".")[0]  # grouped_fwd_sm90.cu.o.ptxas -> grouped_fwd_sm90
            rows.append(r)
    for r, name in zip(rows, demangle([r["mangled"] for r in rows])):
        # c++filt leaves CUTLASS's kernels mangled (pack expansions); one configuration per source
        # file names them.
        if name.startswith("_Z") and "GemmUniversal" in name:
            name = f'cutlass::device_kernel<GemmUniversal> of {r["source"]}.cu'
        r["name"] = name
    compiled = sorted({f'{r["arch"]} {r["name"]}' for r in rows})
    if "--write" in sys.argv:
        header = [l for l in LIST.read_text().splitlines() if l.startswith("#")] if LIST.exists() else []
        LIST.write_text("\n".join(header + compiled) + "\n")
        print(f"wrote {len(compiled)} kernels to {LIST}")
    listed = sorted({l.strip() for l in LIST.read_text().splitlines() if l.strip() and not l.startswith("#")})
    print(f"{'arch':7} {'regs':>4} {'smem':>6} {'stack':>5} {'spill':>5}  kernel")
    for r in sorted(rows, key=lambda r: (r["name"], r["arch"])):
        print(f'{r["arch"]:7} {r["regs"]:4} {r["smem"]:6} {r["stack"]:5} {r["spill"]:5}  {r["name"][:150]}')
    failures = [f'spills {r["spill"]} bytes: {r["arch"]} {r["name"]}' for r in rows if r["spill"] > 0]
    failures += [f"compiled but not in {LIST.name}: {k}" for k in sorted(set(compiled) - set(listed))]
    failures += [f"in {LIST.name} but not compiled: {k}" for k in sorted(set(listed) - set(compiled))]
    print(f"{len(rows)} kernel builds, {len(compiled)} (arch, kernel) pairs, "
          f"max {max(r['regs'] for r in rows)} registers, {sum(r['spill'] > 0 for r in rows)} spilling")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
