"""GLUE tasks from a local directory in the standard layout, or from Hugging Face ``datasets``.

Local files are read as plain tab-separated text with quoting off: GLUE's TSVs contain fields that
begin with a lone ``"`` (RTE, QNLI), which CSV quoting would swallow. Labels become indices in the
order Hugging Face's ``glue`` dataset uses, so local and downloaded data agree. GLUE's test splits
have no labels: the dev split is the evaluation split.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GlueTask:
    name: str  # 'sst2'
    folder: str  # 'SST-2': the standard GLUE directory name
    text_columns: tuple[str, ...]  # TSV header names of the one or two texts
    label_column: str
    labels: tuple[str, ...]  # label strings in index order; () for regression (STS-B)
    eval_splits: dict[str, str]  # split name -> dev file
    metric: str  # 'accuracy' | 'accuracy_f1' | 'matthews' | 'pearson_spearman'
    hf_config: str  # datasets.load_dataset('glue', hf_config)
    hf_columns: tuple[str, ...] = ()  # HF column names of the texts (default: text_columns)
    has_header: bool = True
    positions: tuple[int, ...] = ()  # column positions of texts + label when the file has no header

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1


_DEV = {"validation": "dev.tsv"}
GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("sst2", "SST-2", ("sentence",), "label", ("0", "1"), _DEV, "accuracy", "sst2"),
        GlueTask(
            "qnli",
            "QNLI",
            ("question", "sentence"),
            "label",
            ("entailment", "not_entailment"),
            _DEV,
            "accuracy",
            "qnli",
        ),
        GlueTask(
            "rte",
            "RTE",
            ("sentence1", "sentence2"),
            "label",
            ("entailment", "not_entailment"),
            _DEV,
            "accuracy",
            "rte",
        ),
        GlueTask("qqp", "QQP", ("question1", "question2"), "is_duplicate", ("0", "1"), _DEV, "accuracy_f1", "qqp"),
        GlueTask(
            "mnli",
            "MNLI",
            ("sentence1", "sentence2"),
            "gold_label",
            ("entailment", "neutral", "contradiction"),
            {"validation_matched": "dev_matched.tsv", "validation_mismatched": "dev_mismatched.tsv"},
            "accuracy",
            "mnli",
            hf_columns=("premise", "hypothesis"),
        ),
        GlueTask(
            "mrpc",
            "MRPC",
            ("#1 String", "#2 String"),
            "Quality",
            ("0", "1"),
            _DEV,
            "accuracy_f1",
            "mrpc",
            hf_columns=("sentence1", "sentence2"),
        ),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), "score", (), _DEV, "pearson_spearman", "stsb"),
        GlueTask(
            "cola",
            "CoLA",
            ("sentence",),
            "label",
            ("0", "1"),
            _DEV,
            "matthews",
            "cola",
            has_header=False,
            positions=(3, 1),
        ),
    )
}
_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-m": "mnli", "mnli_m": "mnli"}


@dataclass(frozen=True)
class GlueExample:
    text_a: str
    text_b: str | None
    label: int | float  # index into task.labels; the score for STS-B


def get_task(name: str | GlueTask) -> GlueTask:
    """The task for ``'sst2'``, ``'SST-2'``, ``'sst-2'`` ... (case-insensitive)."""
    if isinstance(name, GlueTask):
        return name
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known: {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def default_eval_split(task: str | GlueTask) -> str:
    """``validation``, or ``validation_matched`` for MNLI."""
    return next(iter(get_task(task).eval_splits))


def glue_files(task: str | GlueTask, root: str | Path) -> dict[str, Path]:
    """``split -> expected local file`` in the standard layout ``<root>/<folder>/<file>``."""
    task = get_task(task)
    folder = Path(root) / task.folder
    return {"train": folder / "train.tsv", **{s: folder / f for s, f in task.eval_splits.items()}}


def load_glue(
    task: str | GlueTask,
    root: str | Path | None,
    split: str = "train",
    *,
    allow_download: bool = True,
    limit: int | None = None,
) -> list[GlueExample]:
    """The examples of one split: from ``<root>/<folder>/*.tsv`` if present, else from HF ``datasets``.

    Raises:
        ValueError: unknown task or split, a malformed row or an unknown label (naming file and line).
        FileNotFoundError: no local file and ``datasets`` unusable; the message names the file expected.
    """
    task = get_task(task)
    valid = ["train", *task.eval_splits]
    if split not in valid:
        raise ValueError(f"split {split!r} of GLUE {task.name}: choose one of {valid} (GLUE test has no labels)")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit(={limit}) must be a positive int or None")
    path = glue_files(task, root)[split] if root else None
    if path is not None and path.is_file():
        return _read_tsv(task, path, limit)
    reason = "no data directory given" if root is None else f"{path} does not exist"
    if allow_download:
        try:
            return _from_hf(task, split, limit)
        except Exception as exc:  # offline, not installed, ...
            reason += f"; Hugging Face datasets could not provide it ({type(exc).__name__}: {str(exc)[:200]})"
    expected = ", ".join(str(p) for p in glue_files(task, root or "<GLUE dir>").values())
    raise FileNotFoundError(
        f"GLUE {task.name} {split}: {reason}. Pass the directory of the standard GLUE layout "
        f"(data.root), which must hold {expected}"
    )


def _read_tsv(task: GlueTask, path: Path, limit: int | None) -> list[GlueExample]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task.has_header:
        header, body, first_line = rows[0], rows[1:], 2
        missing = [c for c in (*task.text_columns, task.label_column) if c not in header]
        if missing:
            raise ValueError(f"{path}: header {header} lacks columns {missing}")
        positions = [header.index(c) for c in (*task.text_columns, task.label_column)]
        width = len(header)
    else:
        body, first_line, positions, width = rows, 1, list(task.positions), None
    examples = []
    for line, row in enumerate(body, start=first_line):
        if not row:
            continue
        if (width is not None and len(row) != width) or max(positions) >= len(row):
            raise ValueError(f"{path}, line {line}: {len(row)} fields, expected {width or max(positions) + 1}")
        texts = [row[p].strip() for p in positions[:-1]]
        examples.append(
            GlueExample(texts[0], texts[1] if len(texts) > 1 else None, _label(task, row[positions[-1]], path, line))
        )
        if limit is not None and len(examples) >= limit:
            break
    return examples


def _label(task: GlueTask, raw: str, path, line) -> int | float:
    raw = raw.strip()
    if not task.labels:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{path}, line {line}: score {raw!r} is not a number") from None
    if raw not in task.labels:
        raise ValueError(f"{path}, line {line}: label {raw!r} is not one of {list(task.labels)}")
    return task.labels.index(raw)


def _from_hf(task: GlueTask, split: str, limit: int | None) -> list[GlueExample]:
    import datasets

    ds = datasets.load_dataset("glue", task.hf_config, split=split if limit is None else f"{split}[:{limit}]")
    columns = task.hf_columns or task.text_columns
    return [
        GlueExample(
            str(row[columns[0]]).strip(),
            str(row[columns[1]]).strip() if len(columns) > 1 else None,
            float(row["label"]) if not task.labels else int(row["label"]),
        )
        for row in ds
    ]


# ------------------------------------------------------------------------------------- held-out validation
# FS's data builder seeds numpy with this before every registered data builder, so it is the seed of the client split
# of every run that sets no data.glue_split_seed (federatedscope.core.auxiliaries.data_builder.get_data)
FS_SPLIT_SEED = 12345
HOLDOUT_SEED = 12345  # like FS's data split: every run, method and seed holds out the same examples


def holdout_size(n: int, holdout: float) -> int:
    """How many of a shard's ``n`` training examples are held out: ``round(holdout * n)`` for a fraction
    ``0 < holdout < 1`` (at least 1 when ``n >= 2``), ``int(holdout)`` for a count ``>= 1``; always leaves at
    least one example to train on, and 0 for ``holdout == 0``."""
    if not 0 <= holdout or holdout != holdout:
        raise ValueError(f"data.glue_holdout(={holdout}) must be 0, a fraction in (0, 1) or a count >= 1")
    if holdout == 0 or n < 2:
        return 0
    k = max(1, round(holdout * n)) if holdout < 1 else int(holdout)
    return min(k, n - 1)


def holdout_split(n: int, holdout: float, client: int) -> tuple[list[int], list[int]]:
    """``(train, held)`` positions of a client's shard of ``n`` training examples: a random ``holdout_size``
    subset, fixed by :data:`HOLDOUT_SEED` and the client's id (not the run's seed), held out for validation
    (hyper-parameter selection never sees the dev set). Both lists are sorted, disjoint and cover ``range(n)``."""
    import random

    k = holdout_size(n, holdout)
    held = sorted(random.Random(HOLDOUT_SEED * 1000 + client).sample(range(n), k))
    chosen = set(held)
    return [i for i in range(n) if i not in chosen], held
