"""Repack a wheel without the files whose names match a pattern (bitsandbytes' libraries for CUDA versions
the target machine does not have), with a RECORD pip accepts and a build tag naming what was kept.

    python benchmarks/gpu/trim_wheel.py DIR PACKAGE PATTERN BUILD_TAG
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(wheel: Path, drop: re.Pattern[str], build_tag: str) -> Path:
    """Write the trimmed wheel beside `wheel` (name-version-BUILD-tags.whl), delete `wheel`, return the new path."""
    name, version, *tags = wheel.stem.split("-")
    if len(tags) != 3:
        raise SystemExit(f"{wheel.name}: already has a build tag or is not a wheel name; not trimming it again")
    out = wheel.with_name(f"{name}-{version}-{build_tag}-{'-'.join(tags)}.whl")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        records, record_name = [], None
        for info in src.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            if drop.search(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):
                data = data.rstrip(b"\n") + f"\nBuild: {build_tag}\n".encode()
            dst.writestr(info, data)
            records.append(_record_line(info.filename, data))
        if record_name is None:
            raise SystemExit(f"{wheel.name}: no .dist-info/RECORD; not a wheel")
        dst.writestr(record_name, "\n".join([*records, f"{record_name},,"]) + "\n")
    wheel.unlink()
    return out


def main() -> None:
    folder, package, pattern, build_tag = sys.argv[1:5]
    wheels = [w for w in Path(folder).glob(f"{package}-*.whl") if len(w.stem.split("-")) == 5]
    for wheel in wheels:
        out = trim(wheel, re.compile(pattern), build_tag)
        print(f"trimmed {wheel.name} -> {out.name} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
