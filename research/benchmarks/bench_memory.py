"""Peak memory of reduced vs dense reconstruction at d = k = 4096, N = 50, r = 16.

Each mode runs in a fresh child process, which makes the client factors first and records its peak
resident set size (ru_maxrss); then it reconstructs, and the growth of the peak is the extra memory
that reconstruction needed. Goal (issue "package foundation"): reduced stays O(N d r), the size of the
uploads, while dense needs O(d k) for the aggregate and its SVD.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from _common import client_factors

from fs_fedpa import reconstruct


def child(mode: str, d: int, n: int, r: int) -> None:
    Bs, As = client_factors(n, d, d, r)
    torch.linalg.qr(torch.randn(64, 8))  # load LAPACK before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reconstruct(Bs, As, r, mode=mode)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "extra_bytes": (after - before) * 1024}))  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--child", choices=["reduced", "dense"])
    args = parser.parse_args()
    d, n, r = args.dim, args.clients, args.rank
    if args.child:
        child(args.child, d, n, r)
        return
    extra = {}
    for mode in ("reduced", "dense"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--dim", str(d), "--clients", str(n), "--rank", str(r)],
            capture_output=True,
            text=True,
            check=True,
        )
        extra[mode] = json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]
    uploads = n * (d + d) * r * 4
    dense_matrix = d * d * 4
    mib = 2**20
    print(f"\nd=k={d}, N={n}, r=R_g={r}, float32")
    print(f"  uploads (N (d+k) r x 4 B)     {uploads / mib:9.1f} MiB")
    print(f"  one dense d x k matrix        {dense_matrix / mib:9.1f} MiB")
    print(f"  reduced: extra peak memory    {extra['reduced'] / mib:9.1f} MiB")
    print(f"  dense:   extra peak memory    {extra['dense'] / mib:9.1f} MiB")
    print()
    print(f"ratio reduced extra memory / uploads: {extra['reduced'] / uploads:.2f} (O(N d r): a small constant)")
    print(f"ratio dense extra memory / reduced extra memory: {extra['dense'] / max(extra['reduced'], 1):.1f}x")


if __name__ == "__main__":
    main()
