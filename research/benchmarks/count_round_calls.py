"""How many calls cross from one fs_fedpa module to another in one client's training round, and how often the
round's conversions run (a profiler's count, not a timing).

Runs stock FS standalone in this process on the tiny Llama (3 clients, all sampled, 3 rounds, FedPA-LoRA, the
tests' tiny config) with ``sys.setprofile`` on while a client handles a training message
(``FedPAClient.callback_funcs_for_model_para``), and on the server while it aggregates. It counts every call whose
caller and callee are functions of two different ``fs_fedpa`` modules, per client round (mean over the rounds of
every client), the calls of the space conversions (``ClientSpace``'s methods) and of ``method.expand`` on the
server per round, and prints the modules pairs most called.

    python research/benchmarks/count_round_calls.py [--repo CHECKOUT] [--method fedpa] [--json FILE]

``--repo``: the checkout whose ``fs_fedpa`` is imported (default: this one), so one command counts two commits:
``git worktree add /tmp/before <commit>`` and ``--repo /tmp/before``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the conversions of a client's factor space: today's two, and those of commits before issue 89 (--repo)
CONVERSIONS = ("ClientSpace.into_model", "ClientSpace.from_model", "ClientSpace.upload", "ClientSpace.download",
               "ClientSpace.to_model")  # fmt: skip


def count(repo: Path, method: str, work: Path) -> dict:
    sys.path.insert(1, str(ROOT))  # the tests' tiny assets, if the checkout lacks them
    import fs_fedpa

    if Path(fs_fedpa.__file__).resolve().parent != (repo / "fs_fedpa").resolve():
        raise SystemExit(f"fs_fedpa imports from {fs_fedpa.__file__}, not from {repo}")
    sys.path.insert(0, str(ROOT / "research" / "benchmarks"))
    from _common import fs_runner

    from fs_fedpa.plugin import client as client_mod
    from fs_fedpa.plugin import server as server_mod
    from fs_fedpa.tools.tiny_llm import build_tiny_llama, write_instruction_jsonl
    from tests.integration.tiny_assets import dump_yaml, fs_llm_yaml

    data, texts = write_instruction_jsonl(work / "data.jsonl", 60)
    model = build_tiny_llama(work / "tiny_llama", texts)
    cfg_dict = fs_llm_yaml(work, model, data, **{
        "federate.method": method, "federate.total_round_num": 3, "federate.share_local_model": True,
        "expname": "calls", "fedpa.lam": 1.0,
    })  # fmt: skip
    runner = fs_runner(dump_yaml(cfg_dict, work / "cfg.yaml"))

    pairs: collections.Counter = collections.Counter()
    named: collections.Counter = collections.Counter()
    rounds = {"client": 0, "server": 0}
    side = ["client"]

    def profiler(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("fs_fedpa"):
            return
        name = frame.f_code.co_name
        qual = getattr(frame.f_code, "co_qualname", name)
        if qual in CONVERSIONS or name == "expand" and "<locals>" not in qual:
            named[f"{side[0]}: {qual}"] += 1
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller.startswith("fs_fedpa") and caller != callee:
            pairs[(side[0], caller, callee)] += 1

    def traced(kind, fn):
        def wrapper(*args, **kwargs):
            rounds[kind] += 1
            side[0] = kind
            sys.setprofile(profiler)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)

        return wrapper

    client_cls = client_mod.FedPAClient
    client_cls.callback_funcs_for_model_para = traced("client", client_cls.callback_funcs_for_model_para)
    # FS keeps bound handlers registered at construction: re-register them on every client
    for client in runner.client.values():
        client.register_handlers("model_para", client.callback_funcs_for_model_para, ["model_para", "ss_model_para"])
    aggregator = server_mod.FedPAAggregator
    aggregator.aggregate = traced("server", aggregator.aggregate)
    runner.run()
    per = {k: max(v, 1) for k, v in rounds.items()}
    total = {kind: sum(n for (s, _, _), n in pairs.items() if s == kind) / per[kind] for kind in per}
    return {
        "repo": str(repo),
        "method": method,
        "client_rounds": rounds["client"],
        "server_rounds": rounds["server"],
        "cross_module_calls_per_client_round": total["client"],
        "cross_module_calls_per_server_round": total["server"],
        "named_per_round": {k: n / per[k.split(":")[0]] for k, n in sorted(named.items())},
        # every pair, most called first (the JSON's; the printout shows the first 12), to diff two commits by
        "pairs": sorted(((f"{s}: {a} -> {b}", n / per[s]) for (s, a, b), n in pairs.items()),
                        key=lambda item: (-item[1], item[0])),  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--method", default="fedpa")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    repo = str(args.repo.resolve())
    if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != repo:
        # fs_fedpa's start-up hook imports it as the interpreter starts: the checkout must lead the path by then
        path = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "PYTHONPATH": path}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    with tempfile.TemporaryDirectory() as tmp:
        out = count(args.repo.resolve(), args.method, Path(tmp))
    print(f"{out['method']} at {out['repo']}: {out['client_rounds']} client rounds, {out['server_rounds']} "
          "aggregations")  # fmt: skip
    print(f"  cross-module calls per client round: {out['cross_module_calls_per_client_round']:.1f}")
    print(f"  cross-module calls per aggregation:  {out['cross_module_calls_per_server_round']:.1f}")
    for name, n in out["named_per_round"].items():
        print(f"  {name}: {n:.1f} a round")
    for name, n in out["pairs"][:12]:
        print(f"  {n:7.1f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
