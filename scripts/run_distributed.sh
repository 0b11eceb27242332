#!/usr/bin/env bash
# Launch a distributed (gRPC) FederatedScope run on this host: the server first, then each client in order
# (FS numbers clients by the order they join). Each party is its own process; on a multi-GPU host give each
# its own device with a per-party override in its yaml (use_gpu: True, device: k).
#
#   scripts/run_distributed.sh yaml_configs/distributed/server.yaml yaml_configs/distributed/client_{1,2,3}.yaml \
#       -- data.root ../shared/data/glue
#
# Arguments after -- are FS overrides for every party. Logs go to $LOGDIR (default exp/distributed_logs);
# JOIN_WAIT seconds (default 8) separate the start of two parties. Exits with the first non-zero status.
set -euo pipefail
PY=${PYTHON:-python3}
LOGDIR=${LOGDIR:-exp/distributed_logs}
JOIN_WAIT=${JOIN_WAIT:-8}
cfgs=()
opts=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then
    shift
    opts=("$@")
    break
  fi
  cfgs+=("$1")
  shift
done
if [ ${#cfgs[@]} -lt 2 ]; then
  echo "usage: $0 SERVER.yaml CLIENT.yaml [CLIENT.yaml ...] [-- KEY VALUE ...]" >&2
  exit 2
fi
mkdir -p "$LOGDIR"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for i in "${!cfgs[@]}"; do
  "$PY" -m federatedscope.main --cfg "${cfgs[$i]}" ${opts[@]+"${opts[@]}"} >"$LOGDIR/party$i.log" 2>&1 &
  pids+=($!)
  echo "[run_distributed] party $i (${cfgs[$i]}): pid $!, log $LOGDIR/party$i.log"
  sleep "$JOIN_WAIT"
done
status=0
for p in "${pids[@]}"; do
  wait "$p" || { s=$?; [ $status -eq 0 ] && status=$s; }
done
trap - EXIT
echo "[run_distributed] all parties finished (status $status)"
exit $status
