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
# AUTH=1 (the default) makes a fresh key per client for this run in $LOGDIR/keys (mode 600): the server gets the
# keyring (fedpa.auth_keyring), client i its own key (fedpa.auth_key) and with it the id i, whatever the order in
# which the clients join (docs/distributed.md). AUTH=0 runs without message authentication.
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
AUTH=${AUTH:-1}
party_opts=()  # per party: its key option
if [ "$AUTH" = 1 ]; then
  keys="$LOGDIR/keys"
  mkdir -p "$keys"
  chmod 700 "$keys"
  : >"$keys/keyring"
  chmod 600 "$keys/keyring"
  for ((i = 1; i < ${#cfgs[@]}; i++)); do
    key=$("$PY" -c "import secrets; print(secrets.token_hex(32))")
    (umask 077 && echo "$key" >"$keys/client_$i.key")
    echo "$i $key" >>"$keys/keyring"
  done
  party_opts[0]="fedpa.auth_keyring $keys/keyring"
  for ((i = 1; i < ${#cfgs[@]}; i++)); do party_opts[i]="fedpa.auth_key $keys/client_$i.key"; done
fi
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for i in "${!cfgs[@]}"; do
  # shellcheck disable=SC2086  # a key option is two words without spaces
  "$PY" -m federatedscope.main --cfg "${cfgs[$i]}" ${opts[@]+"${opts[@]}"} ${party_opts[$i]:-} >"$LOGDIR/party$i.log" 2>&1 &
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
