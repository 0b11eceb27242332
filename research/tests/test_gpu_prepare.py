"""The GPU-host folder (``gpu_check --prepare``) gzips the large model files to fit a 64 MiB transfer, and
``research/scripts/gpu_host.sh`` unpacks them on the host: the bytes that arrive are the bytes that left."""

from __future__ import annotations

import gzip
import os
import re
import subprocess

from research.tools.gpu_prepare import gzip_large_files
from tests.conftest import ROOT


def _folder(tmp_path):
    minilm = tmp_path / "minilm"
    minilm.mkdir()
    weights = os.urandom(50_000) + bytes(100_000)  # half noise, half zeros: compresses, but not to nothing
    (minilm / "model.safetensors").write_bytes(weights)
    (minilm / "config.json").write_text('{"hidden_size": 384}')
    return minilm, weights


def test_large_files_are_gzipped_and_small_ones_left(tmp_path):
    minilm, weights = _folder(tmp_path)
    packed = gzip_large_files(minilm, min_bytes=1 << 16)
    assert packed == [minilm / "model.safetensors.gz"]
    assert sorted(p.name for p in minilm.iterdir()) == ["config.json", "model.safetensors.gz"]
    assert gzip.decompress(packed[0].read_bytes()) == weights
    assert packed[0].stat().st_size < len(weights)
    assert gzip_large_files(minilm, min_bytes=1 << 16) == []  # nothing packed twice


def test_gpu_host_unpacks_what_prepare_packed(tmp_path):
    minilm, weights = _folder(tmp_path)
    gzip_large_files(minilm, min_bytes=1 << 16)
    script = (ROOT / "research" / "scripts" / "gpu_host.sh").read_text()
    loop = re.search(r"^for packed in .*?^done$", script, re.S | re.M)
    assert loop, "gpu_host.sh no longer unpacks DIR/minilm/*.gz"
    unpack = ["bash", "-c", f'set -euo pipefail; carry="{tmp_path}"\n{loop.group(0)}']
    subprocess.run(unpack, check=True)
    assert (minilm / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in minilm.iterdir()) == ["config.json", "model.safetensors"]
    subprocess.run(unpack, check=True)  # a second pass finds nothing to unpack and does not fail
