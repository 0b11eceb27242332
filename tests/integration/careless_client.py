"""FS's standalone run with one careless client, as a subclass of the plugin's client could behave (run as
``python -m tests.integration.careless_client CFG KIND CLIENT ROUND``): in round ROUND, client CLIENT sends nothing
(``silent``), or sends its update labelled round -1 (``round -1``), with a string round (``string state``), with
a timestamp before that of the server's message (``earlier timestamp``), with 10^6 as its training set's size
(``misreported size``) or with no size at all (``no size``); with a DP account of 10^15 steps and epsilon 10^4
(``absurd steps``) or of 10^6 records (``absurd n``); or without its DP account (``without dp``: what a client whose
own config says ``fedpa.dp.mode none`` sends). Every other message is the plugin's own."""

from __future__ import annotations

import runpy
import sys


def main(cfg_file: str, kind: str, client: int, rnd: int) -> None:
    from fs_fedpa.plugin.client import FedPAClient

    honest = FedPAClient.callback_funcs_for_model_para

    def careless(self, message):
        if (self.ID, message.state) != (client, rnd):
            return honest(self, message)
        if kind == "silent":
            return None
        send = self.comm_manager.send

        def mislabelled(out):
            if out.msg_type == "model_para":
                if kind == "round -1":
                    out.state = -1
                elif kind == "string state":
                    out.state = str(out.state)
                elif kind == "earlier timestamp":
                    out.timestamp = message.timestamp - 1.0
                elif kind == "misreported size":  # DP-SGD on its n_i records, reporting 10^6
                    out.content[1]["stats"]["num_train_data"] = 10**6
                elif kind == "no size":  # its DP account, and no num_train_data
                    del out.content[1]["stats"]["num_train_data"]
                elif kind == "absurd steps":
                    out.content[1]["stats"].update(dp_steps=10**15, dp_epsilon=1e4)
                elif kind == "absurd n":
                    out.content[1]["stats"]["dp_n"] = 10**6
                elif kind == "without dp":  # as NoPrivacy's policy sends: every stat but an account
                    stats = out.content[1]["stats"]
                    for key in [k for k in stats if k.startswith("dp_")]:
                        del stats[key]
            return send(out)

        self.comm_manager.send = mislabelled
        try:
            return honest(self, message)
        finally:
            self.comm_manager.send = send

    FedPAClient.callback_funcs_for_model_para = careless
    sys.argv = ["federatedscope.main", "--cfg", cfg_file]
    runpy.run_module("federatedscope.main", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
