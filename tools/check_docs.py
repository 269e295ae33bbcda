#!/usr/bin/env python3
"""Checks that the documentation's cross-references hold (CTest `docs_check`, label scripts).

- Every relative link in README.md, ARCHITECTURE.md, docs/*.md and tools/reference/README.md
  names a file that exists, and a #fragment into a markdown page names one of its headings
  (GitHub's anchors).
- Every reference in the repository's text of the form `docs/PAGE.md, "Title"` (also README,
  ARCHITECTURE.md; with or without the comma) names a heading or a **bold** lead-in of that page
  that starts with Title, so moving or renaming a section breaks this check, not the reader.
- Every `path` into the tree the pages name in code marks (src/, tools/, scripts/, configs/, tests/,
  bench/, cmake/, web/, fuzz/) exists; a glob (`configs/bench/gpu_*.toml`) must match something.
- README.md stays a front door: at most 12,000 bytes (the manual lives in docs/).

Usage: tools/check_docs.py [--root DIR] [--self-test]. --self-test plants each kind of break in a
scratch copy and fails unless every one adds a finding.
"""
import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

README_BYTES = 12000
PAGES = ["README.md", "ARCHITECTURE.md", "docs/*.md", "tools/reference/README.md"]
SCANNED = ["src", "tools", "tests", "scripts", "configs", "web", "docs", "bench", "cmake", "fuzz", ".ci",
           "README.md", "ARCHITECTURE.md", "CMakeLists.txt"]
TEXT_EXT = (".h", ".cpp", ".cu", ".cuh", ".inc", ".py", ".sh", ".md", ".toml", ".txt", ".cmake", ".html", ".js", "")
SECTION_REF = re.compile(r'((?:docs/[A-Za-z0-9_-]+\.md)|README(?:\.md)?|ARCHITECTURE\.md),? \(?"([^"\n]+)"')


def without_code(text):
    """The text with fenced code blocks and inline code blanked (links there are examples)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def anchors(text):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen, out = {}, set()
    for line in without_code_blocks(text).split("\n"):
        m = re.match(r"^#{1,6} +(.*?) *#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def without_code_blocks(text):
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def titles(text):
    """Headings and bold lead-ins of a page, lower case, inline code marks and "1. " numbering dropped."""
    body = without_code_blocks(text)
    out = [m.group(1) for m in re.finditer(r"^#{1,6} +(.*)$", body, flags=re.M)]
    out += re.findall(r"\*\*([^*\n]+)\*\*", body)
    return [re.sub(r"^\d+\. ", "", t.replace("`", "").lower()) for t in out]


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def check_links(root):
    bad = []
    pages = sorted({p for pattern in PAGES for p in glob.glob(os.path.join(root, pattern))})
    for page in pages:
        text = without_code(read(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, mailto:
            path, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = f"{os.path.relpath(page, root)}: link {target}"
            if not os.path.exists(dest):
                bad.append(f"{where}: {os.path.relpath(dest, root)} does not exist")
            elif fragment and dest.endswith(".md") and fragment not in anchors(read(dest)):
                bad.append(f"{where}: no heading of {os.path.relpath(dest, root)} has the anchor #{fragment}")
    return bad


def scanned_files(root):
    for entry in SCANNED:
        top = os.path.join(root, entry)
        if os.path.isfile(top):
            yield top
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in ("golden", "corpus", "__pycache__")]
            for name in files:
                path = os.path.join(folder, name)
                # This file's own examples and planted breaks are not references.
                if os.path.splitext(name)[1] in TEXT_EXT and os.path.basename(path) != os.path.basename(__file__):
                    yield path


def check_section_refs(root):
    bad = []
    for path in scanned_files(root):
        text = read(path)
        for m in SECTION_REF.finditer(text):
            page, title = m.group(1), m.group(2)
            page = "README.md" if page == "README" else page
            line = text.count("\n", 0, m.start()) + 1
            where = f"{os.path.relpath(path, root)}:{line}: {m.group(0)}"
            dest = os.path.join(root, page)
            if not os.path.exists(dest):
                bad.append(f"{where}: {page} does not exist")
            elif not any(t.startswith(title.replace("`", "").lower()) for t in titles(read(dest))):
                bad.append(f"{where}: {page} has no heading or bold lead-in starting with \"{title}\"")
    return bad


def check_paths(root):
    bad = []
    pages = sorted({p for pattern in PAGES for p in glob.glob(os.path.join(root, pattern))})
    for page in pages:
        for m in re.finditer(r"`((?:src|tools|scripts|configs|tests|bench|cmake|web|fuzz)/[\w./*-]+)`", read(page)):
            path = os.path.join(root, m.group(1))
            if not glob.glob(path):
                bad.append(f"{os.path.relpath(page, root)}: names {m.group(1)}, which does not exist")
    return bad


def check_readme_size(root):
    n = os.path.getsize(os.path.join(root, "README.md"))
    return [] if n <= README_BYTES else [f"README.md is {n} bytes, over {README_BYTES}: move detail into docs/"]


def check(root):
    return check_links(root) + check_section_refs(root) + check_paths(root) + check_readme_size(root)


def skipped(root, folder, names):
    """What the scratch copy leaves out: git data and the root's build and run folders."""
    out = {n for n in names if n in (".git", "__pycache__")}
    if os.path.samefile(folder, root):
        out |= {n for n in names if os.path.isdir(os.path.join(folder, n))
                and (n.startswith("build") or n in (".cache", "data", "runs"))}
    return out


def self_test(root):
    """Each planted break must add a finding to what the unplanted copy reports."""
    plants = [
        ("a link to a missing page", "README.md", "\n[gone](docs/NO_SUCH_PAGE.md)\n"),
        ("a link to a missing heading", "README.md", "\n[gone](docs/CONFIG.md#no-such-heading)\n"),
        ("a stale section reference", "src/config/config.h", '\n// (docs/CONFIG.md, "No such section")\n'),
        ("a path that does not exist", "docs/DATA.md", "\nSee `src/no_such_folder/reader.cpp`.\n"),
        ("an oversized README", "README.md", "\n" + "x" * README_BYTES + "\n"),
    ]
    failures = []
    with tempfile.TemporaryDirectory() as scratch:
        copy = os.path.join(scratch, "repo")
        shutil.copytree(root, copy, ignore=lambda folder, names: skipped(root, folder, names))
        before = check(copy)  # what the tree itself has (the plants are judged by what they add)
        for what, rel, text in plants:
            target = os.path.join(copy, rel)
            original = read(target)
            with open(target, "a") as f:
                f.write(text)
            if not [b for b in check(copy) if b not in before]:
                failures.append(f"{what} in {rel} was not reported")
            with open(target, "w") as f:
                f.write(original)
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    bad = self_test(args.root) if args.self_test else check(args.root)
    for b in bad:
        print(b)
    print(f"{'self-test' if args.self_test else 'docs check'}: {'FAILED' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
