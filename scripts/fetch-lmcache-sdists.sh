#!/usr/bin/env bash
# Fetch the source distributions of the LMCache versions kvactors is tested against (0.5.6,
# 0.5.7rc2) into a cache outside the checkout and outside the venv store's keys, for
# tests/testing/test_lmcache_device_suites.py (LMCache's own MLU / MUSA device tests, run on
# the fakes). The .tar.gz files are downloaded as files from PyPI and checked against pinned
# sha256 digests: nothing is built (preparing LMCache's sdist metadata may try to build its
# CUDA code). A file already there with the right digest is kept, so a warm run does no I/O
# but hashing.
#
#   bash scripts/fetch-lmcache-sdists.sh            # into KVACTORS_LMCACHE_SDISTS, default
#                                                   # ~/.cache/kvactors/lmcache-sdists
# Prints the directory on its last line.
set -euo pipefail
DEST="${KVACTORS_LMCACHE_SDISTS:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kvactors/lmcache-sdists}"
mkdir -p "$DEST"
"${PYTHON_BOOT:-python3}" - "$DEST" <<'PYEOF'
import hashlib
import os
import sys
import urllib.request

FILES = {  # file name: (PyPI file URL, sha256)
    "lmcache-0.5.6.tar.gz": (
        "https://files.pythonhosted.org/packages/84/25/"
        "3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz",
        "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e",
    ),
    "lmcache-0.5.7rc2.tar.gz": (
        "https://files.pythonhosted.org/packages/d5/f1/"
        "393d6743e1b43762cf2685ca2af2a3f51a3727fc4a373418834fb843d485/lmcache-0.5.7rc2.tar.gz",
        "afe0713416c9b5a55ac2202560893dabe268ea72c9c778ef7fc75d818a7cd96f",
    ),
}


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


dest = sys.argv[1]
for name, (url, sha) in FILES.items():
    path = os.path.join(dest, name)
    if os.path.exists(path) and digest(path) == sha:
        print(f"fetch-lmcache-sdists: {name} present")
        continue
    tmp = f"{path}.part.{os.getpid()}"
    with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as out:
        while block := resp.read(1 << 20):
            out.write(block)
    got = digest(tmp)
    if got != sha:
        os.unlink(tmp)
        sys.exit(f"fetch-lmcache-sdists: {name}: sha256 {got}, expected {sha}")
    os.replace(tmp, path)  # atomic: a concurrent run never sees a partial file
    print(f"fetch-lmcache-sdists: {name} downloaded")
print(dest)
PYEOF
