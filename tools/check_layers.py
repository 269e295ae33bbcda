#!/usr/bin/env python3
"""The include layering of src/: a folder includes only itself and the folders below it.

The order, bottom to top, is written here once; there is no exception list. Every folder of src/
must have a place in it, so a new folder is placed before it can include anything. Reads each
source file's `#include "folder/..."` lines (quoted includes whose first component is a folder
of src/; system and third-party headers are not ours to order) and prints every include that
runs upward as `file:line: folder -> folder`, then exits 1. The build runs it (target
include_layers) and so does a test that plants an upward include (tests/scripts/).

usage: check_layers.py SRC_DIR
"""
import os
import re
import sys

# Bottom to top. What each layer is: ARCHITECTURE.md, "Folders".
LAYERS = ["core", "kernels", "config", "data", "report", "model", "optim", "parallel", "checkpoint",
          "plan", "train", "cli"]

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/[^"]*"')
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".inc", ".in")


def violations(src):
    """(file, line number, from folder, to folder) for every upward include under src."""
    folders = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    unplaced = [d for d in folders if d not in LAYERS]
    if unplaced:
        raise SystemExit(f"check_layers: src folder(s) {', '.join(unplaced)} have no place in LAYERS "
                         f"({os.path.abspath(__file__)}): put each where it belongs")
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = []
    for folder in folders:
        for root, _, files in os.walk(os.path.join(src, folder)):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(root, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if m and m.group(1) in rank and rank[m.group(1)] > rank[folder]:
                            found.append((os.path.relpath(path, os.path.dirname(os.path.abspath(src))),
                                          number, folder, m.group(1)))
    return found


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    found = violations(argv[1])
    for path, number, lower, upper in found:
        print(f"{path}:{number}: {lower}/ includes {upper}/, a layer above it")
    if found:
        print(f"check_layers: {len(found)} upward include(s); the order, bottom to top: {' < '.join(LAYERS)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
