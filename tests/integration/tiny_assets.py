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
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# Special tokens FS's get_tokenizer checks (llm/dataset/llm_dataset.py:DefaultToken). Defining all
# four means get_tokenizer adds none, so FS never resizes/mean-initialises the embeddings.
PAD, EOS, BOS, UNK = "[PAD]", "</s>", "<s>", "<unk>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]  # ids 0..3

# Verbatim copy of federatedscope/llm/dataset/llm_dataset.py:PROMPT_DICT (llm branch @7f086944);
# used only if FS cannot be imported. _fs_prompt_dict() prefers the installed FS copy.
_PROMPT_DICT_FALLBACK = {
    "prompt_input": (
        "Below is an instruction that describes a task, "
        "paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:"
        "\n{input}\n\n### Response:"),
    "prompt_no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"),
}

# Synthetic categories: name -> words that give it away. Category 0/1 form a sentiment task.
_CATEGORY_WORDS = {
    "positive": ["good", "great", "fun", "lovely", "happy", "excellent", "bright", "warm"],
    "negative": ["bad", "awful", "boring", "sad", "terrible", "dull", "cold", "ugly"],
    "sports": ["ball", "goal", "team", "match", "coach", "score", "race", "player"],
    "food": ["bread", "soup", "rice", "apple", "cheese", "salad", "cake", "pasta"],
    "music": ["song", "guitar", "drum", "piano", "melody", "band", "tune", "choir"],
    "weather": ["rain", "snow", "wind", "storm", "sunny", "cloud", "fog", "thunder"],
    "travel": ["train", "plane", "hotel", "map", "ticket", "beach", "road", "trip"],
    "science": ["atom", "cell", "energy", "planet", "theory", "lab", "gene", "laser"],
}
_FILLER = ["the", "a", "this", "was", "very", "really", "and", "it", "so", "quite"]
_OBJECTS = ["movie", "book", "day", "story", "show", "place", "thing", "event"]
_INSTRUCTIONS = ("Classify the sentiment of the review .", "Which topic is this text about ?")
MAX_CATEGORIES = len(_CATEGORY_WORDS)


def _fs_prompt_dict() -> dict:
    try:  # lazy: only when building the tokenizer
        from federatedscope.llm.dataset.llm_dataset import PROMPT_DICT
        return dict(PROMPT_DICT)
    except Exception:  # pragma: no cover - FS missing or broken
        return dict(_PROMPT_DICT_FALLBACK)


def _prompt_chunks(prompt_dict: dict) -> list[str]:
    """Literal pieces of the FS prompt templates between the ``{field}`` placeholders."""
    chunks: list[str] = []
    for tmpl in prompt_dict.values():
        for piece in re.split(r"\{[a-z_]+\}", tmpl):
            if piece and piece not in chunks:
                chunks.append(piece)
    return chunks


# --------------------------------------------------------------------------------------------- #
# 1. tokenizer + model
# --------------------------------------------------------------------------------------------- #
def build_tiny_llama(
    path,
    vocab_texts: Iterable[str],
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    *,
    intermediate: int | None = None,
    max_positions: int = 256,
    compact_prompt: bool = True,
    model_max_length: int = 32,
) -> str:
    """Train a word-level tokenizer on ``vocab_texts`` and save it with a random tiny Llama at ``path``.

    * Tokenizer: ``tokenizers`` WordLevel + Whitespace pre-tokenizer (``\\w+|[^\\w\\s]+``), special
      tokens ``[PAD]``/``<unk>``/``<s>``/``</s>`` (ids 0..3), no BOS/EOS post-processor (FS appends
      ``</s>`` to the target text itself). Wrapped in ``PreTrainedTokenizerFast`` and saved.
    * ``compact_prompt`` (default): each literal chunk of FS's Alpaca prompt templates (e.g. the
      whole "Below is an instruction ... ### Instruction:\\n" preamble) becomes ONE added token, so a
      full prompt+answer fits in ``llm.tok_len: 32``. Without it the preamble alone is ~35 word
      tokens: with tok_len 32 the answer is truncated away, every label is -100 and the HF loss is
      NaN (LLMTrainer then silently skips the batch).
    * Model: ``LlamaForCausalLM(LlamaConfig(...))`` under ``torch.manual_seed(seed)``, vocab = len(tokenizer),
      untied embeddings, saved with ``save_pretrained`` (safetensors).

    Loads offline with ``AutoTokenizer.from_pretrained(path, use_fast=False, padding_side='right',
    model_max_length=...)`` and ``AutoModelForCausalLM.from_pretrained(path)``. Returns ``str(path)``.
    """
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    texts = [str(t) for t in vocab_texts]
    prompt_dict = _fs_prompt_dict()
    # Template words go into the vocabulary either way (covers compact_prompt=False).
    texts += [re.sub(r"\{[a-z_]+\}", " ", t) for t in prompt_dict.values()]

    tok = Tokenizer(models.WordLevel(vocab={}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=100_000, min_frequency=1, special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(texts, trainer=trainer)
    if compact_prompt:
        tok.add_tokens(
            [
                AddedToken(c, single_word=False, lstrip=False, rstrip=False, normalized=False)
                for c in _prompt_chunks(prompt_dict)
            ]
        )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="right",
        model_max_length=model_max_length,
    )
    hf_tok.save_pretrained(str(path))

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


# --------------------------------------------------------------------------------------------- #
# 2. data
# --------------------------------------------------------------------------------------------- #
def make_instruction_records(n: int, seed: int = 0, num_categories: int = 2) -> list[dict]:
    """Deterministic records ``{instruction, input, output, category}``; output == category name.

    Labels are balanced (``i % K``, then shuffled) so pandas category codes are contiguous 0..K-1
    (required by FS's LDA splitter). K=2 is a sentiment task, K>2 a topic task.
    """
    if not 1 <= num_categories <= MAX_CATEGORIES:
        raise ValueError(f"num_categories must be in 1..{MAX_CATEGORIES}")
    rng = random.Random(seed)
    names = list(_CATEGORY_WORDS)[:num_categories]
    instruction = _INSTRUCTIONS[0] if num_categories <= 2 else _INSTRUCTIONS[1]
    labels = [i % num_categories for i in range(n)]
    rng.shuffle(labels)
    records = []
    for lab in labels:
        name = names[lab]
        words = rng.sample(_CATEGORY_WORDS[name], 2)
        text = " ".join([rng.choice(_FILLER), rng.choice(_OBJECTS), rng.choice(_FILLER), words[0], "and", words[1]])
        records.append({"instruction": instruction, "input": text, "output": name, "category": name})
    return records


def write_instruction_jsonl(path, n: int, seed: int = 0, num_categories: int = 2) -> tuple[str, list[str]]:
    """Write ``n`` FS-LLM jsonl lines (keys read by ``load_jsonl``: instruction/input/output/category).

    Returns ``(abs_path, texts)`` where ``texts`` is a vocabulary corpus for ``build_tiny_llama``
    covering every category (also those not sampled).
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    records = make_instruction_records(n, seed=seed, num_categories=num_categories)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    texts = [f"{r['instruction']} {r['input']} {r['output']}" for r in records]
    texts += [" ".join(ws) + " " + name for name, ws in _CATEGORY_WORDS.items()]
    texts += [" ".join(_FILLER + _OBJECTS), _INSTRUCTIONS[0], _INSTRUCTIONS[1]]
    return str(path), texts


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
        if "." in key:
            set_dotted(cfg, key, value)
        else:
            cfg[key] = value
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
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS", "1"),
        "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
    })
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
    ``python <python_args> -m federatedscope.main --cfg <yaml> <extra_opts>`` (cwd=tmpdir).

    Output is captured as text; ``subprocess.TimeoutExpired`` propagates after ``timeout`` s.
    ``extra_opts`` are FS ``KEY VALUE`` pairs, e.g. ``['federate.total_round_num', '3']``.
    """
    tmpdir = Path(tmpdir).resolve()
    tmpdir.mkdir(parents=True, exist_ok=True)
    cfg_path = dump_yaml(cfg_dict, tmpdir / yaml_name)
    cmd = [sys.executable, *python_args, "-m", "federatedscope.main", "--cfg", cfg_path, *map(str, extra_opts)]
    return subprocess.run(
        cmd, cwd=str(tmpdir), env=fs_env(env), capture_output=True, text=True, timeout=timeout
    )


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
