#!/usr/bin/env bash
# fs_fedpa entry point.
#   ./run.sh test [pytest args]   install what the tests need (CPU torch, the package) and run them
#                                 (FS_FEDPA_FS_SOURCE=<archive or folder>: FederatedScope from a local copy)
#   ./run.sh [--data GLUE_DIR]    the main job: FedPA-LoRA on real SST-2 with the embedded MiniLM, on CPU
#                                 (GLUE_DIR holds SST-2/train.tsv and SST-2/dev.tsv; or set FS_FEDPA_DATA)
#   ./run.sh compare --data GLUE_DIR [--plan] [--hours H]
#                                 the tuned SST-2 comparison protocol, resumable (docs/compare.md)
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

install_package() {
  echo "[run.sh] installing fs_fedpa with extras [$1]"
  "$PY" -m pip install --quiet --disable-pip-version-check ".[$1]"
}

case "${1:-main}" in
  test)
    shift || true
    ensure_torch
    install_package test
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
  main | --data)
    [ "${1:-}" = main ] && shift
    ensure_torch
    install_package demo
    ensure_federatedscope
    exec "$PY" -m fs_fedpa.tools.sst2_demo "$@"
    ;;
  compare)
    shift
    ensure_torch
    install_package demo
    ensure_federatedscope
    exec "$PY" -m fs_fedpa.tools.sst2_compare "$@"
    ;;
  *)
    echo "usage: ./run.sh [--data GLUE_DIR] | ./run.sh compare --data GLUE_DIR | ./run.sh test [pytest args]" >&2
    exit 2
    ;;
esac
