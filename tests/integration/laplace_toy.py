"""A toy DP mechanism that plugs in through :mod:`fs_fedpa.privacy` alone (issue 73): Laplace noise on each client's
uploaded factors, then FS's usual aggregation. Run as ``python -m tests.integration.laplace_toy --cfg <yaml>``: it
registers ``fedpa.dp.mode laplace`` and runs stock ``federatedscope.main``.

The mechanism: a client clips its uploaded factors (all of B and A, one vector) to L1 norm C and adds Laplace noise of
scale 2C/epsilon per coordinate, pure epsilon-DP of one round's upload under replace-one adjacency of the client's
whole data (L1 sensitivity 2C); T rounds compose to T epsilon. It sends no statistic but ``state_lost``, and 1 as its
sample count. A test of the interface, not a mechanism fs_fedpa ships.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import torch

from fs_fedpa.privacy import Entry, register
from fs_fedpa.privacy.policy import EVERY_EXPORT, ClientPolicy, Mechanism, ServerPolicy

MODE = "laplace"


class LaplaceClient(ClientPolicy):
    def upload(self, factors: dict, rnd: int) -> dict:
        C, epsilon = float(self.fedpa.dp.clip), float(self.fedpa.dp.epsilon)
        l1 = sum(float(t.abs().sum()) for B, A in factors.values() for t in (B, A))
        scale = min(1.0, C / max(l1, 1e-30))
        noise = torch.distributions.Laplace(0.0, 2 * C / epsilon)
        return {n: (B * scale + noise.sample(B.shape).to(B), A * scale + noise.sample(A.shape).to(A))
                for n, (B, A) in factors.items()}  # fmt: skip

    def stats(self, stats: dict, rounds_trained: int = 0) -> dict:
        return {k: v for k, v in stats.items() if k == "state_lost"}

    def sample_size(self, sample_size: int) -> int:
        return 1


class LaplaceServer(ServerPolicy):
    def __init__(self, cfg, method, **kwargs):
        super().__init__(cfg, method, **kwargs)
        self.rounds = 0

    def account(self, rnd: int, receivers: list[int], stats: dict) -> dict:
        self.rounds += 1
        line = {"round": rnd, "dp_mode": MODE, "dp_epsilon": self.rounds * float(self.method.cfg.dp.epsilon),
                "dp_delta": 0.0, "dp_adjacency": "replace_one", "dp_sampling": "all", "dp_accountant": "basic"}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.last = line
        return line

    def summary(self) -> str:
        return f"[toy] Laplace on the client update: epsilon {self.rounds * float(self.method.cfg.dp.epsilon):g}"

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def load_state_dict(self, saved: dict, path: str) -> None:
        self.rounds = int(saved["rounds"])


class Laplace(Mechanism):
    Server, Client = LaplaceServer, LaplaceClient

    @classmethod
    def accounting_settings(cls, cfg) -> dict:
        return {f"fedpa.{k}": getattr(cfg.fedpa, k) for k in ("dp_mode", "dp_clip", "dp_epsilon")}

    @classmethod
    def export_info(cls, fedpa, outdir: Path) -> dict:
        shared, own = EVERY_EXPORT
        return {"dp_mode": MODE, "epsilon": None, "delta": 0.0, "dp_files": shared, "not_dp_files": own}


register(MODE, Entry("tests.integration.laplace_toy:Laplace", title="Laplace noise on the client update"))

if __name__ == "__main__":
    runpy.run_module("federatedscope.main", run_name="__main__")
