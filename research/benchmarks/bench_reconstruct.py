"""Per-layer server reconstruction: reduced and randomized vs dense, side by side.

Goals (issue "package foundation"): reduced >= 100x faster than dense at d=1024 (N=10, r=4) and
>= 1000x at d=4096 (N=6, r=8), with relative excess Frobenius error <= 1e-5:
    (||X - B_g A_g||_F - ||X - X_opt||_F) / ||X||_F,   X = sum_i w_i B_i A_i,  X_opt its best rank-R_g approximation.
The errors are measured in float64 outside the timing: ||X - X_opt|| from the singular values of X
(float64 dense SVD at d=1024; the float64 QR core at d=4096, where a float64 dense SVD would dominate
the run), ||X - B_g A_g|| through fs_fedpa.aggregation_error in float64.
"""

from __future__ import annotations

import argparse

import torch
from _common import client_factors, fmt, median_time

from fs_fedpa import aggregation_error, reconstruct


def excess_error(Bs, As, B_g, A_g, rank: int, dense_reference: bool) -> float:
    Bs64, As64 = [B.double() for B in Bs], [A.double() for A in As]
    if dense_reference:
        S = torch.linalg.svdvals(sum(B @ A for B, A in zip(Bs64, As64)) / len(Bs))
    else:
        S = reconstruct(Bs64, As64, rank, return_spectrum=True)[2]
    optimum = float(S[rank:].pow(2).sum().sqrt())
    norm = float(S.pow(2).sum().sqrt())
    got = float(aggregation_error(Bs64, As64, B_g.double(), A_g.double()))
    return (got - optimum) / norm


def run(d: int, n: int, r: int, repeats: int, dense_repeats: int, device: str = "cpu") -> dict[str, float]:
    Bs, As = client_factors(n, d, d, r, seed=d)
    Bs, As = [B.to(device) for B in Bs], [A.to(device) for A in As]
    gen = torch.Generator(device=device).manual_seed(0)
    t = {
        "reduced": median_time(lambda: reconstruct(Bs, As, r, mode="reduced"), repeats),
        "randomized": median_time(lambda: reconstruct(Bs, As, r, mode="randomized", generator=gen), repeats),
        "dense": median_time(lambda: reconstruct(Bs, As, r, mode="dense"), dense_repeats),
    }
    errors = {
        mode: excess_error(Bs, As, *reconstruct(Bs, As, r, mode=mode, generator=gen), r, dense_reference=d <= 1024)
        for mode in ("reduced", "randomized", "dense")
    }
    print(f"\nd=k={d}, N={n}, r=R_g={r}, float32, {device}, {torch.get_num_threads()} CPU threads")
    for mode in t:
        print(f"  {mode:10s} {fmt(t[mode])}   relative excess error {errors[mode]: .2e}")
    return {"d": d, "n": n, "r": r, **{f"t_{m}": v for m, v in t.items()}, **{f"e_{m}": v for m, v in errors.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dense-repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU host; see docs/algorithm.md)")
    parser.add_argument("--tiny", action="store_true", help="d = 256 and 512: checks that it runs, not the goals")
    args = parser.parse_args()
    dev = args.device
    (d1, n1, r1), (d2, n2, r2) = ((256, 4, 4), (512, 4, 8)) if args.tiny else ((1024, 10, 4), (4096, 6, 8))
    results = [run(d1, n1, r1, args.repeats, args.dense_repeats, dev), run(d2, n2, r2, args.repeats, 1, dev)]
    print()
    for res, goal in zip(results, (100, 1000)):
        where = f"d={res['d']},N={res['n']},r={res['r']}"
        print(
            f"speedup dense/reduced @ {where}: {res['t_dense'] / res['t_reduced']:.0f}x (goal >= {goal}x); "
            f"excess error {res['e_reduced']:.1e} (goal <= 1e-5)"
        )
        print(
            f"speedup dense/randomized @ {where}: {res['t_dense'] / res['t_randomized']:.0f}x; "
            f"excess error {res['e_randomized']:.1e} (sketch l = min(R_g + 8, N r))"
        )


if __name__ == "__main__":
    main()
