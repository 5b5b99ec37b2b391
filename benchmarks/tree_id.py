"""The git tree id of a copy of the repository, computed without git or .git: the commit a result came from.

python -m grpo_fast.benchmarks.tree_id [ROOT] [--exclude PATH ...]      # prints e.g. 3f9c...

A copy of the working tree sent to another machine carries no .git, so `git rev-parse HEAD` cannot say which code
ran there. The tree id can: it is what `git rev-parse HEAD^{tree}` prints for a clean checkout of the same commit
(blobs and trees hashed as git hashes them, files that .gitignore ignores left out), and
`git log --all --format='%H %T' | grep TREE_ID` names the commit. A copy with uncommitted changes has a tree id
that no commit has. --exclude: paths carried beside the tree that are no part of it (a folder of wheels).

The ignore rules read are the forms this repository's .gitignore files use: `name`, `*.glob`, `dir/` (directories
only) and `/anchored` patterns, each relative to the folder of its .gitignore; a negated pattern (`!keep`) is an
error, not a silent mismatch.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import stat
import sys


def _rules(folder: str, relative: str) -> list:
    """(pattern, directories only, anchored, base) of folder/.gitignore; base is the folder relative to the root."""
    path = os.path.join(folder, ".gitignore")
    if not os.path.isfile(path):
        return []
    rules = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n").strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("!"):
                raise ValueError(f"{path}: negated pattern {line!r}: tree_id reads no such rules")
            directories_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = line.startswith("/") or "/" in line
            rules.append((line.lstrip("/"), directories_only, anchored, relative))
    return rules


def _ignored(relative: str, is_dir: bool, rules: list) -> bool:
    for pattern, directories_only, anchored, base in rules:
        if directories_only and not is_dir:
            continue
        inside = relative if not base else relative[len(base) + 1:]
        if anchored and inside.count("/") == pattern.count("/") and fnmatch.fnmatchcase(inside, pattern):
            return True
        if not anchored and fnmatch.fnmatchcase(os.path.basename(relative), pattern):
            return True
    return False


def _object_id(kind: str, data: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).digest()


def _tree(folder: str, relative: str, rules: list, excluded: set):
    """The binary id of folder's tree object, or None when nothing in it is part of the tree (git keeps no
    empty folders)."""
    rules = rules + _rules(folder, relative)
    entries = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        child = f"{relative}/{name}" if relative else name
        info = os.lstat(path)
        is_dir = stat.S_ISDIR(info.st_mode)
        if name == ".git" or child in excluded or _ignored(child, is_dir, rules):
            continue
        if stat.S_ISLNK(info.st_mode):
            entries.append((name, b"120000", _object_id("blob", os.fsencode(os.readlink(path)))))
        elif is_dir:
            tree = _tree(path, child, rules, excluded)
            if tree is not None:
                entries.append((name, b"40000", tree))
        elif stat.S_ISREG(info.st_mode):
            with open(path, "rb") as f:
                blob = _object_id("blob", f.read())
            entries.append((name, b"100755" if info.st_mode & stat.S_IXUSR else b"100644", blob))
    if not entries:
        return None
    # git orders a tree's entries by name, a folder's name as if it ended in "/"
    entries.sort(key=lambda e: os.fsencode(e[0]) + (b"/" if e[1] == b"40000" else b""))
    data = b"".join(mode + b" " + os.fsencode(name) + b"\0" + object_id for name, mode, object_id in entries)
    return _object_id("tree", data)


def tree_id(root: str = ".", exclude=()) -> str:
    """The git tree id (40 hex digits) of the tree at root, without its ignored files and the paths in exclude
    (relative to root, or absolute)."""
    root = os.path.abspath(root)
    excluded = {os.path.relpath(os.path.abspath(os.path.join(root, p)), root) for p in exclude}
    tree = _tree(root, "", [], excluded)
    return (tree or _object_id("tree", b"")).hex()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_fast.benchmarks.tree_id", description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=".")
    parser.add_argument("--exclude", nargs="*", default=[], help="paths carried beside the tree, not part of it")
    args = parser.parse_args(argv)
    print(tree_id(args.root, args.exclude))
    return 0


if __name__ == "__main__":
    sys.exit(main())
