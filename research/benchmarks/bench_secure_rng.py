"""What the cryptographic DP generator costs (``fedpa.dp.secure_rng``): the noise and sampling of one round drawn
from the OS's CSPRNG (two Gaussians summed, :class:`fs_fedpa.privacy.mechanism.SecureGenerator`) against torch's MT19937.

(a) sample level: one client's round of DP-SGD, 10 steps of b = 16 records out of 5,000, noise on every trainable
    entry (MiniLM-L6 with LoRA r = 4 on query and value and a 2-class head: D = 37,634);
(b) client level: one server release, K = 10 of 100 clients, noise on each (d, k) = (384, 384) product of the 12
    adapted modules (1.77 M entries).

Printed side by side in one run: seconds per round for each generator and their ratio, and the share of a measured
protocol round they add on this project's CPU (10 clients x 10 steps: about 64 s of machine time under DP-SGD, where
each of the 10 clients draws (a); about 23 s without, where the server draws (b) once).
"""

from __future__ import annotations

import argparse

import torch
from _common import interleaved_times

from fs_fedpa.privacy.mechanism import dp_generator, gaussian, sample_without_replacement

SAMPLE_D, STEPS, BATCH, RECORDS = 37_634, 10, 16, 5_000
MODULES, SIDE, K, N = 12, 384, 10, 100
# the protocol's median machine time a round on this project's CPU (sst2_compare --plan): under DP-SGD, and plain
ROUND_SECONDS = {"sample": 64.0, "client": 23.0}
CLIENTS = 10


def sample_round(generator) -> None:
    like = torch.zeros(())
    for _ in range(STEPS):
        sample_without_replacement(RECORDS, BATCH, generator)
        gaussian((SAMPLE_D,), 1.0, generator, like)


def client_release(generator) -> None:
    like = torch.zeros(())
    sample_without_replacement(N, K, generator)
    for _ in range(MODULES):
        gaussian((SIDE, SIDE), 1.0, generator, like)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu", help="accepted for gpu_check; the draws are made on the host")
    args = parser.parse_args()
    secure, mt = dp_generator(), dp_generator(secure=False)
    rows = []
    cases = (("(a) DP-SGD, one client's round", sample_round, "sample", CLIENTS),
             ("(b) client-level release", client_release, "client", 1))  # fmt: skip
    for label, fn, mode, draws in cases:
        times = interleaved_times({"secure": lambda: fn(secure), "mt19937": lambda: fn(mt)}, repeats=args.repeats)
        rows.append((label, times["secure"], times["mt19937"], mode, draws))
    print(f"\nnoise and sampling of one round, {torch.get_num_threads()} threads, median of {args.repeats}")
    for label, s, m, *_ in rows:
        print(f"{label}: CSPRNG {s * 1e3:.1f} ms, MT19937 {m * 1e3:.1f} ms")
    print()
    for label, s, m, mode, draws in rows:
        extra = draws * (s - m)
        print(f"{label}: ratio CSPRNG / MT19937 {s / m:.2f}; {extra * 1e3:.0f} ms more a protocol round "
              f"({draws} draw{'s' if draws > 1 else ''}), {100 * extra / ROUND_SECONDS[mode]:.2f}% of its "
              f"{ROUND_SECONDS[mode]:g} s")  # fmt: skip


if __name__ == "__main__":
    main()
