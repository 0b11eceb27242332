"""fedpa.base_quantization through FederatedScope: its checks and refusals on FS's own config; int8 and nf4 runs on
the tiny causal LM and the tiny BERT classifier that complete and train another adapter than the float32 base; an
adapter trained on an nf4 base, exported, loaded by PEFT on the float32 base."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.tiny_assets import dump_yaml, fs_glue_yaml, fs_llm_yaml, outdir_of, run_fs

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("quantization")]  # one worker: the runs are shared

BNB = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed: the quantized FS runs are SKIPPED (pip install 'fs_fedpa[quant]')",
)
WRITERS = ("fedex_lora", "flora", "fed_plora", "feddpa_t", "feddpa_f")


def _yaml(kind: str, assets: dict, tmp: Path, **overrides) -> dict:
    """One round of FedPA on the tiny assets: ``llm`` (causal LM, FS-LLM's own model type) or ``glue`` (BERT)."""
    common = {"federate.total_round_num": 1, "expname": "run", **overrides}
    if kind == "llm":
        return fs_llm_yaml(tmp, assets["model"], assets["data"], **{"federate.method": "fedpa", **common})
    return fs_glue_yaml(tmp, assets["model"], assets["glue"], **common)


def _merged(cfg_dict: dict, tmp: Path, *opts: str):
    """FS's config with ``cfg_dict`` and ``opts`` merged, every check run (as ``federatedscope.main`` does)."""
    from federatedscope.core.configs.config import global_cfg

    cfg = global_cfg.clone()
    cfg.merge_from_file(dump_yaml(cfg_dict, tmp / "cfg.yaml"))
    cfg.merge_from_list(list(opts))
    return cfg


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("method", WRITERS)
def test_a_method_that_writes_the_base_is_refused_naming_it_and_the_key(tiny_glue, tmp_path, method):
    cfg = _yaml("glue", tiny_glue, tmp_path, **{"federate.method": method})
    with pytest.raises(ValueError, match=rf"federate.method '{method}' .* fedpa.base_quantization 'int8' keeps them"):
        _merged(cfg, tmp_path, "fedpa.base_quantization", "int8")


def test_a_missing_backend_is_refused_with_the_extra_to_install(tiny_glue, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # its import fails, as where it is not installed
    cfg = _yaml("glue", tiny_glue, tmp_path)
    with pytest.raises(ValueError, match=r"needs bitsandbytes and accelerate.*pip install 'fs_fedpa\[quant\]'"):
        _merged(cfg, tmp_path, "fedpa.base_quantization", "nf4")


@pytest.mark.parametrize(
    ("kind", "opts", "message"),
    [
        ("llm", ("llm.adapter.use", "False"), "llm.adapter.use False trains every weight"),
        ("glue", ("model.type", "lr"), "quantizes the base of '<name>@seqcls_llm' and '<name>@huggingface_llm'"),
        ("glue", ("use_gpu", "True", "train.is_enable_half", "True"), "train.is_enable_half casts the whole model"),
    ],
    ids=["full_training", "other_model", "half"],
)
def test_what_cannot_train_on_a_quantized_base_is_refused(tiny_llm, tiny_glue, tmp_path, kind, opts, message):
    cfg = _yaml(kind, tiny_llm if kind == "llm" else tiny_glue, tmp_path)
    with pytest.raises(ValueError, match=message):
        _merged(cfg, tmp_path, "fedpa.base_quantization", "nf4", *opts)


@BNB
def test_the_builders_get_the_quantization_and_what_get_llm_reads(tiny_llm, tmp_path):
    # Execute
    cfg = _merged(_yaml("llm", tiny_llm, tmp_path), tmp_path, "fedpa.base_quantization", "nf4")
    fedavg = {"federate.method": "FedAvg", "fedpa.base_quantization": "nf4"}
    other = _merged(_yaml("llm", tiny_llm, tmp_path, **fedavg), tmp_path)
    # Assert
    node = cfg.model.fedpa_base
    assert (node.quantization, node.data_root, node.tok_len, node.adapter_use) == (
        "nf4", cfg.data.root, cfg.llm.tok_len, True
    )  # fmt: skip
    assert node.adapter_args == [dict(cfg.llm.adapter.args[0])]
    assert other.model.fedpa_base.quantization == "none"  # FS's own FedAvg ignores the fedpa section


# -------------------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def runs(tiny_llm, tiny_glue, tmp_path_factory):
    """``runs(kind, quantization)``: the exported global adapter of one finished run, run once."""
    done: dict[tuple[str, str], dict] = {}

    def run(kind: str, q: str) -> dict:
        if (kind, q) not in done:
            tmp = tmp_path_factory.mktemp(f"{kind}_{q}")
            cfg = _yaml(kind, tiny_llm if kind == "llm" else tiny_glue, tmp, **{
                "fedpa.base_quantization": q, "fedpa.export.dir": str(tmp / "export"),
                **({"fedpa.records.save_outcomes": True} if kind == "glue" else {}),
            })  # fmt: skip
            proc = run_fs(cfg, tmp)
            assert proc.returncode == 0, proc.stderr[-4000:]
            from safetensors.torch import load_file

            done[(kind, q)] = {
                "log": proc.stdout + proc.stderr,
                "export": tmp / "export",
                "outdir": outdir_of(cfg),
                "adapter": load_file(tmp / "export" / "global" / "adapter_model.safetensors"),
            }
        return done[(kind, q)]

    return run


@BNB
@pytest.mark.parametrize("q", ["int8", "nf4"])
@pytest.mark.parametrize("kind", ["llm", "glue"])
def test_a_quantized_run_completes_and_trains_another_adapter(runs, kind, q):
    # Execute
    quantized, full = runs(kind, q), runs(kind, "none")
    # Assert: the base was quantized, and the factors trained on it are finite, of the same modules and shapes, and
    # not those trained on the float32 base
    assert f"[fedpa] base loaded in {q}:" in quantized["log"] and "[fedpa] base loaded" not in full["log"]
    a, b = quantized["adapter"], full["adapter"]
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()} and a
    assert all(torch.isfinite(v).all() for v in a.values())
    gaps = [float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k].norm() > 0]
    assert max(gaps) > 1e-2, f"{kind} {q}: the adapter barely differs from the float32 run's (relative gaps {gaps})"


def _dev(tiny_glue) -> list:
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.seqcls import _encode
    from fs_fedpa.tasks.glue import default_eval_split, load_glue

    tokenizer = AutoTokenizer.from_pretrained(tiny_glue["model"])
    return _encode(load_glue("sst2", tiny_glue["glue"], default_eval_split("sst2")), tokenizer, 16)


def _logits(model, examples) -> torch.Tensor:
    from fs_fedpa.plugin.seqcls import trim_padding

    model.eval()
    with torch.no_grad():
        return torch.cat([
            model(**trim_padding({k: torch.stack([e[0][k] for e in examples[i : i + 8]]) for k in examples[0][0]}))
            .logits.float() for i in range(0, len(examples), 8)
        ])  # fmt: skip


@BNB
def test_an_adapter_trained_on_nf4_loads_with_peft_on_the_float32_base(runs, tiny_glue):
    """The export holds float32 factors and heads only, so PEFT loads it on either base; on the nf4 base it makes the
    run's own predictions, on the float32 base it adds the same update to the unrounded W_0."""
    from transformers import AutoModelForSequenceClassification

    from fs_fedpa import quantization
    from fs_fedpa.export import load

    # Prepare
    run = runs("glue", "nf4")
    shards = json.loads((run["outdir"] / "fedpa_eval_shards.json").read_text())["splits"]["val"]
    rows = [json.loads(line) for line in (run["outdir"] / "fedpa_outcomes.jsonl").read_text().splitlines()]
    last = max(r["round"] for r in rows)
    outcomes = {
        r["client"]: r["correct"] for r in rows if (r["round"], r["protocol"], r["split"]) == (last, "global", "val")
    }
    dev = _dev(tiny_glue)
    gaps, same = [], []
    for client, indices in shards.items():
        examples, labels = [dev[i] for i in indices], torch.tensor([dev[i][1] for i in indices])
        # Execute: the client's paper-protocol model (global adapter, its head) on each base
        bases = {
            "nf4": AutoModelForSequenceClassification.from_pretrained(
                tiny_glue["model"], num_labels=2, **quantization.load_kwargs("nf4", keep=quantization.HEADS)
            ),
            "float32": AutoModelForSequenceClassification.from_pretrained(tiny_glue["model"], num_labels=2),
        }
        logits = {
            name: _logits(load(base, run["export"], client=int(client)), examples) for name, base in bases.items()
        }
        # Assert: on its own base the export makes the run's predictions, bit for bit
        right = (logits["nf4"].argmax(-1) == labels).tolist()
        assert right == [c == "1" for c in outcomes[int(client)]], f"client {client}: nf4 predictions differ"
        gaps.append(float((logits["float32"] - logits["nf4"]).abs().max()))
        same += (logits["float32"].argmax(-1) == logits["nf4"].argmax(-1)).tolist()
    # the float32 base moves the logits (W_0 is not rounded there) and keeps finite, mostly equal predictions
    assert 0 < max(gaps) < 1.0 and sum(same) / len(same) >= 0.8, (gaps, sum(same) / len(same))
