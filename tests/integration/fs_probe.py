"""Run one FederatedScope job in this process with spies on the FedPA workers; save what they saw.

Used by the integration tests as ``python -m tests.integration.fs_probe CFG.yaml OUT.pt [opts ...]``
in a subprocess (FS changes process-wide state, e.g. ``torch.set_num_threads(1)``). The spies
only copy what passes through the plugin's own seams; they change nothing:

- ``enter``: per client and round, the factors the model trains from and the ranks it received;
- ``leave``: per client and round, the factors it keeps and the keys/ranks of its upload;
- ``aggregate``: per round, an independent decode of the uploads, their weights and clients, and
  the global factors the server adopted;
- ``loss_gap``: ``loss_task - loss_batch`` of every training batch (the added alignment term);
- ``final``: every client's kept factors and the server's global factors at the end.

One deliberate fault, for the reliability tests: ``FS_PROBE_CORRUPT="client:round:kind,..."`` makes that
client's upload of that round carry a NaN (``kind`` nan), an A with one row too many (``kind`` shape), or, in
place of a B, a base64 pickle that creates the file ``FS_PROBE_CANARY`` if anyone unpickles it (``kind``
pickle), after the spy recorded it. The aggregation spy records None for an upload it cannot decode.
"""

from __future__ import annotations

import os
import sys

import torch


class Canary:
    """Unpickling this calls ``open(path, "w")``, so the file exists afterwards if anyone unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _copy(factors):
    return {n: (B.detach().cpu().clone(), A.detach().cpu().clone()) for n, (B, A) in factors.items()}


def _corrupt(upload: dict, client: int, rnd: int) -> dict:
    faults = dict(
        ((int(c), int(r)), kind)
        for c, r, kind in (f.split(":") for f in os.environ.get("FS_PROBE_CORRUPT", "").split(",") if f)
    )
    kind = faults.get((client, rnd))
    if kind is None:
        return upload
    lora = dict(upload["lora"])
    key = sorted(k for k in lora if k.endswith("A" if kind == "shape" else "B"))[0]
    if kind == "pickle":
        import base64
        import pickle

        lora[key] = base64.b64encode(pickle.dumps(Canary(os.environ["FS_PROBE_CANARY"]))).decode()
        return {**upload, "lora": lora}
    bad = lora[key].clone()
    if kind == "nan":
        bad[0, 0] = float("nan")
    else:
        bad = torch.cat([bad, bad[:1]])
    lora[key] = bad
    return {**upload, "lora": lora}


def main(cfg_file: str, out: str, opts: list[str]) -> None:
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.auxiliaries.logging import update_logger
    from federatedscope.core.auxiliaries.runner_builder import get_runner
    from federatedscope.core.auxiliaries.utils import setup_seed
    from federatedscope.core.auxiliaries.worker_builder import get_client_cls, get_server_cls
    from federatedscope.core.configs.config import global_cfg

    from fs_fedpa import lora
    from fs_fedpa.plugin import client as client_mod
    from fs_fedpa.plugin import server as server_mod
    from fs_fedpa.plugin.payload import decode_factors, decode_parts

    record = {"enter": [], "leave": [], "aggregate": [], "loss_gap": []}
    Client, Aggregator = client_mod.FedPAClient, server_mod.FedPAAggregator

    orig_init, orig_enter, orig_leave = Client.__init__, Client._enter_round, Client._leave_round
    orig_aggregate = Aggregator.aggregate

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if self._cfg is not None:

            def gap(ctx):
                record["loss_gap"].append(float((ctx.loss_task - ctx.loss_batch).detach()))

            self.trainer.register_hook_in_train(new_hook=gap, trigger="on_batch_forward")

    def enter(self, payload):
        orig_enter(self, payload)
        received = decode_factors(payload["lora"])
        record["enter"].append(
            {
                "client": self.ID,
                "round": self.state,
                "start": _copy(lora.get_factors(self.model)),
                "received_ranks": sorted({B.shape[1] for B, _ in received.values()}),
            }
        )

    def leave(self):
        upload = orig_leave(self)
        record["leave"].append(
            {
                "client": self.ID,
                "round": self.state,
                "end": _copy(self.factors),
                "local": {n: t.detach().cpu().clone() for n, t in self.local_tensors.items()},
                "upload_keys": sorted(upload["lora"]) + sorted(upload.get("shared", {})),
                "upload_ranks": sorted({_rank(p) for p in decode_parts(upload["lora"]).values()}),
            }
        )
        return _corrupt(upload, self.ID, self.state)

    def aggregate(self, agg_info):
        weights = [float(n) for n, _ in agg_info["client_feedback"]]
        clients = [c for c, _ in agg_info["staleness"]]
        server = self.server  # uploads as the server completes them (a method may send one factor only)
        uploads = []
        for c, (_, content) in zip(clients, agg_info["client_feedback"]):
            try:
                parts = decode_parts(content["lora"])
            except ValueError:
                uploads.append(None)
                continue
            uploads.append(_copy(server.method.complete_upload(parts, server.global_factors, c - 1)))
        result = orig_aggregate(self, agg_info)
        record["aggregate"].append(
            {
                "round": self.server.state,
                "uploads": uploads,
                "weights": weights,
                "clients": clients,
                "global": _copy(self.server.global_factors),
            }
        )
        return result

    Client.__init__, Client._enter_round, Client._leave_round = init, enter, leave
    Aggregator.aggregate = aggregate

    cfg = global_cfg.clone()
    cfg.merge_from_file(cfg_file)
    cfg.merge_from_list(opts)
    update_logger(cfg, clear_before_add=True)
    setup_seed(cfg.seed)
    data, modified = get_data(config=cfg.clone(), client_cfgs=None)
    cfg.merge_from_other_cfg(modified)
    cfg.freeze()
    runner = get_runner(
        data=data,
        server_class=get_server_cls(cfg),
        client_class=get_client_cls(cfg),
        config=cfg.clone(),
        client_configs=None,
    )
    runner.run()
    record["final"] = {
        "clients": {cid: _copy(c.factors) for cid, c in runner.client.items() if c.factors is not None},
        "global": _copy(runner.server.global_factors),
        "outdir": cfg.outdir,
    }
    torch.save(record, out)


def _rank(parts) -> int:
    return parts["B"].shape[1] if "B" in parts else parts["A"].shape[0]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
