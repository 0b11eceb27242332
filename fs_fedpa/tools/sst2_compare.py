"""The CPU reference comparison: every method on real SST-2 with the embedded MiniLM, 3 seeds (docs/compare.md).

    ./run.sh compare --data <GLUE dir>            # or: python -m fs_fedpa.tools.sst2_compare --data <GLUE dir>

Runs :mod:`fs_fedpa.compare` over ``yaml_configs/compare_sst2_minilm_cpu.yaml`` (N=10, LDA beta=0.5, r=4) for
:data:`METHODS` x seeds 0, 1, 2 and writes the table and the figures into ``--out``; rerunning it resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fs_fedpa import compare
from fs_fedpa.methods import names
from fs_fedpa.tools.sst2_demo import find_glue_dir

CFG_NAME = Path("yaml_configs") / "compare_sst2_minilm_cpu.yaml"
CFG = CFG_NAME if CFG_NAME.is_file() else Path(__file__).resolve().parents[2] / CFG_NAME
FIRST = ("fedpa", "fedit", "flexlora")
METHODS = (*FIRST, *(m for m in names() if m not in FIRST))  # every method of fs_fedpa.methods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="GLUE folder (or set FS_FEDPA_DATA)")
    parser.add_argument("--out", default="exp/compare_sst2_minilm_cpu", help="runs, table and figures")
    parser.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    args = parser.parse_args(argv)
    if not CFG.is_file():
        sys.exit(f"{CFG} not found: run this from a checkout of fs_fedpa (the config lives in yaml_configs/)")
    glue = find_glue_dir(args.data)
    return compare.main(
        ["--cfg", str(CFG), "--methods", *args.methods, "--seeds", *args.seeds, "--out", args.out]
        + ["data.root", str(glue)]
    )


if __name__ == "__main__":
    sys.exit(main())
