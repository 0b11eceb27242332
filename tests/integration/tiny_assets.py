"""Tiny, fully offline assets for FS-LLM integration tests.

Everything here is built locally in seconds: a word-level tokenizer trained on the fly, a random
2-layer Llama, a synthetic instruction jsonl, a stock FedAvg+LoRA yaml, a subprocess runner for
``python -m federatedscope.main`` and a parser for ``eval_results.log``.

Import-light on purpose: no FederatedScope import at module import time and transformers /
tokenizers / torch only inside the functions, so test collection stays cheap.

Typical use::

    data, texts = write_instruction_jsonl(tmp / "data.jsonl", 60)
    model_dir = build_tiny_llama(tmp / "tiny_llama", texts)
    cfg = fs_llm_yaml(tmp, model_dir, data, **{"federate.share_local_model": True})
    proc = run_fs(cfg, tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_eval_results(outdir_of(cfg))
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fs_fedpa.tools.tiny_llm import (  # noqa: F401
    build_tiny_bert,
    build_tiny_llama,
    make_instruction_records,
    write_instruction_jsonl,
    write_tiny_glue,
)


# --------------------------------------------------------------------------------------------- #
# 3. config
# --------------------------------------------------------------------------------------------- #
def set_dotted(d: dict, dotted: str, value: Any) -> dict:
    """``set_dotted(cfg, 'federate.share_local_model', True)``: create intermediate dicts as needed."""
    node = d
    keys = dotted.split(".")
    for k in keys[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[keys[-1]] = value
    return d


def fs_llm_yaml(tmpdir, model_dir, data_file, **overrides) -> dict:
    """Config dict for a stock FS-LLM FedAvg + peft-LoRA standalone run on CPU (dump with yaml).

    ``overrides`` use dotted keys; since Python kwargs cannot contain dots pass them via ``**{...}``:
    ``fs_llm_yaml(tmp, m, d, **{'federate.share_local_model': True, 'federate.total_round_num': 3})``.
    A plain (dot-free) key whose value is a dict replaces that whole section.
    """
    tmpdir = Path(tmpdir).resolve()
    data_file = Path(data_file).resolve()
    model_dir = Path(model_dir).resolve()
    for p in (data_file, model_dir):  # FS does type.split('@') and unpacks two values
        if "@" in str(p):
            raise ValueError(f"FS cannot take a path containing '@': {p}")
    cfg: dict = {
        "use_gpu": False,
        "device": -1,
        "seed": 0,
        "backend": "torch",
        "outdir": str(tmpdir / "exp"),
        "expname": "tiny_fedavg",
        "wandb": {"use": False},
        "early_stop": {"patience": 0},
        "federate": {
            "mode": "standalone",
            "method": "FedAvg",
            "client_num": 3,
            "total_round_num": 2,
            "share_local_model": False,
            "online_aggr": False,
            "save_to": "",
        },
        "data": {
            # load_llm_dataset does os.path.join(data.root, '<name>.jsonl'): an absolute path wins.
            "root": str(tmpdir / "data"),
            "type": f"{data_file}@llm",
            "splits": [0.8, 0.1, 0.1],
            "splitter": "iid",
        },
        "llm": {
            "tok_len": 32,
            "adapter": {
                "use": True,
                "args": [
                    {"adapter_package": "peft", "adapter_method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
                ],
            },
        },
        "dataloader": {"batch_size": 2},
        "model": {"type": f"{model_dir}@huggingface_llm"},
        "train": {
            "local_update_steps": 2,
            "batch_or_epoch": "batch",
            "optimizer": {"type": "AdamW", "lr": 0.01, "weight_decay": 0.0},
        },
        "criterion": {"type": "CrossEntropyLoss"},
        "trainer": {"type": "llmtrainer"},
        "eval": {
            "freq": 1,
            "metrics": ["loss"],
            "best_res_update_round_wise_key": "val_loss",
            "count_flops": False,
        },
    }
    for key, value in overrides.items():
        set_dotted(cfg, key, value)
    return cfg


# --------------------------------------------------------------------------------------------- #
# 4. run
# --------------------------------------------------------------------------------------------- #
def fs_env(extra: dict | None = None) -> dict:
    """Subprocess env: offline HF, no wandb, single-threaded BLAS (tiny model; FS's standalone
    runner calls torch.set_num_threads(1) anyway, but only after data/model loading) and
    ``PYTHONWARNINGS=ignore`` unless already set, to keep captured stderr readable. ``extra``
    overrides, e.g. ``{'PYTHONPATH': '/work/main'}`` or ``{'PYTHONWARNINGS': 'default'}``."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS", "1"),
            "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
        }
    )
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def dump_yaml(cfg_dict: dict, path) -> str:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg_dict, f, sort_keys=False)
    return str(path)


def run_fs(
    cfg_dict: dict,
    tmpdir,
    extra_opts: Sequence[str] = (),
    python_args: Sequence[str] = (),
    timeout: float = 300,
    *,
    yaml_name: str = "fs_cfg.yaml",
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Dump ``cfg_dict`` to ``tmpdir/yaml_name`` and run
    ``python <python_args> -m federatedscope.main --cfg <yaml> <extra_opts>`` (cwd=tmpdir; see :func:`run_module`).

    Output is captured as text; ``subprocess.TimeoutExpired`` propagates after ``timeout`` s.
    ``extra_opts`` are FS ``KEY VALUE`` pairs, e.g. ``['federate.total_round_num', '3']``.
    """
    tmpdir = Path(tmpdir).resolve()
    tmpdir.mkdir(parents=True, exist_ok=True)
    cfg_path = dump_yaml(cfg_dict, tmpdir / yaml_name)
    return run_module(
        "federatedscope.main", ["--cfg", cfg_path, *extra_opts], tmpdir, fs_env(env), timeout, python_args=python_args
    )


def run_module(module: str, args: Sequence, cwd, env: dict, timeout: float | None, python_args: Sequence[str] = ()):
    """``subprocess.run([python, *python_args, -m, module, *args], ...)`` with output captured as text, forked from
    the tests' zygote where that is the same run (tests/integration/zygote.py)."""
    from tests.integration import zygote

    root = Path(__file__).resolve().parents[2]
    return zygote.run_module(module, args, cwd, env, timeout, base=fs_env(), root=str(root), python_args=python_args)


# --------------------------------------------------------------------------------------------- #
# 5. outputs
# --------------------------------------------------------------------------------------------- #
def outdir_of(cfg_dict: dict, latest: bool = True) -> Path:
    """The run's outdir as built by FS ``update_logger``: ``<outdir>/<expname>[_<expname_tag>]``.

    If that dir already existed when the run started, FS writes to ``.../sub_exp_<YYYYmmddHHMMSS>``
    instead; with ``latest`` the newest such sub-dir is returned when present. If ``expname`` is
    empty FS derives it from method/model.type/data.type (paths with '/' become nested dirs), so
    always set ``expname``.
    """
    base = Path(cfg_dict.get("outdir") or Path.cwd() / "exp")
    expname = cfg_dict.get("expname", "")
    if not expname:
        raise ValueError("set cfg['expname']: FS's default expname embeds model/data paths")
    tag = cfg_dict.get("expname_tag", "")
    if tag:
        expname = f"{expname}_{tag}"
    out = base / expname
    if latest and out.is_dir():
        subs = sorted(p for p in out.glob("sub_exp_*") if p.is_dir())
        if subs:
            return subs[-1]
    return out


_NP_SCALAR = re.compile(r"\bnp\.(?:float|int|uint|bool|str|complex)\w*\(\s*([^()]*?)\s*\)")
_BARE_NONFINITE = re.compile(r"(?<![\w'\".])(nan|inf)(?![\w'\"])")
_NAN_MARK = "__tiny_assets_nan__"


def _unmark_nan(obj):
    if isinstance(obj, dict):
        return {k: _unmark_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unmark_nan(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unmark_nan(v) for v in obj)
    return float("nan") if obj == _NAN_MARK else obj


def parse_eval_line(line: str) -> dict:
    """Parse one ``eval_results.log`` line (``str(dict)``), tolerating numpy-2 scalar reprs
    (``np.float64(1.2)``, ``np.int64(3)``) and bare ``nan``/``inf``."""
    s = _NP_SCALAR.sub(r"\1", line.strip())
    s = _BARE_NONFINITE.sub(lambda m: f"'{_NAN_MARK}'" if m.group(1) == "nan" else "1e999", s)
    return _unmark_nan(ast.literal_eval(s))


def read_eval_results(outdir) -> list[dict]:
    """All lines of ``<outdir>/eval_results.log`` parsed to dicts, in file order.

    Layout of a FedAvg run with ``eval.freq: 1`` and R rounds (observed, FS llm branch):

    * R server lines ``{'Role': 'Server #', 'Round': r, 'Results_weighted_avg': {...},
      'Results_avg': {...}, 'Results_fairness': {...}}`` for r = 0..R-1 (one per ``eval.report``
      form); ``Round r`` is the global model *after* r+1 aggregations (no pre-training eval).
      Metrics: ``{test,val}_loss`` (sum of batch-mean losses x batch size), ``_total``, ``_avg_loss``.
    * one ``{'Role': 'Server #', 'Round': 'Final', 'Results_raw': {'client_best_individual': ...,
      'client_summarized_weighted_avg': ..., ...}}``;
    * one ``{'Role': 'Client #k', 'Round': R, 'Results_raw': {...}}`` per client (last eval).
    """
    p = Path(outdir) / "eval_results.log"
    rows = []
    with open(p) as f:
        for line in f:
            if line.strip():
                rows.append(parse_eval_line(line))
    return rows


def round_results(rows: list[dict], form: str = "Results_weighted_avg") -> dict[int, dict]:
    """``{round: metrics}`` for the server's per-round lines (skips 'Final' and client lines)."""
    out = {}
    for r in rows:
        if r.get("Role") == "Server #" and isinstance(r.get("Round"), int) and form in r:
            out[r["Round"]] = r[form]
    return out


# --------------------------------------------------------------------------------------------- #
# 6. sequence classification: a tiny random BERT and a tiny GLUE directory
# --------------------------------------------------------------------------------------------- #
def fs_glue_yaml(tmpdir, model_dir, glue_root, **overrides) -> dict:
    """FedPA on ``sst2@glue`` with the tiny BERT: 3 clients, LDA(0.5), 2 rounds, local classifier heads."""
    tmpdir = Path(tmpdir).resolve()
    cfg: dict = {
        "use_gpu": False,
        "device": -1,
        "seed": 0,
        "outdir": str(tmpdir / "exp"),
        "expname": "tiny_glue",
        "early_stop": {"patience": 0},
        "federate": {
            "mode": "standalone",
            "method": "fedpa",
            "client_num": 3,
            "total_round_num": 2,
            "share_local_model": True,
        },
        "data": {"root": str(glue_root), "type": "sst2@glue", "splitter": "lda", "splitter_args": [{"alpha": 0.5}]},
        "llm": {"tok_len": 16},
        "model": {"type": f"{Path(model_dir).resolve()}@seqcls_llm", "seqcls": {"r": 4, "lora_alpha": 8}},
        "personalization": {"local_param": ["classifier"]},
        "dataloader": {"batch_size": 8},
        "train": {"local_update_steps": 4, "batch_or_epoch": "batch", "optimizer": {"type": "AdamW", "lr": 0.01}},
        "criterion": {"type": "CrossEntropyLoss"},
        "trainer": {"type": "seqcls"},
        "eval": {
            "freq": 1,
            "metrics": ["acc", "f1"],
            "split": ["val"],
            "best_res_update_round_wise_key": "val_acc",
            "count_flops": False,
        },
        "fedpa": {"lam": 1.0},
    }
    for key, value in overrides.items():
        set_dotted(cfg, key, value)
    return cfg
