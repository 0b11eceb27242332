#!/usr/bin/env bash
# Launch a distributed (gRPC) FederatedScope run on this host: the server first, then each client in order
# (FS numbers clients by the order they join). Each party is its own process.
#
#   scripts/run_distributed.sh yaml_configs/distributed/server.yaml yaml_configs/distributed/client_{1,2,3}.yaml \
#       -- data.root ../shared/data/glue
#
# Arguments after -- are FS overrides for every party. Logs go to $LOGDIR (default exp/distributed_logs);
# JOIN_WAIT seconds (default 8) separate the start of two parties. Exits with the first non-zero status.
# AUTH=1 (the default) makes a fresh key per client for this run in $LOGDIR/keys (mode 600): the server gets the
# keyring (fedpa.net.auth_keyring), client i its own key (fedpa.net.auth_key) and with it the id i, whatever the order in
# which the clients join (docs/distributed.md). AUTH=0 runs without message authentication.
# TLS=1 makes a CA and a certificate per party for this run in $LOGDIR/certs (python -m fs_fedpa.tools.make_certs);
# TLS=FOLDER takes them from FOLDER (ca.pem, server.{pem,key}, client_<i>.{pem,key}): party i then gets
# fedpa.net.tls_cert, tls_key and tls_ca, and every connection is mutual TLS, client i's id that of its certificate.
# TLS=0 (the default): plaintext.
# GPUS=0,1,... spreads the parties over this host's GPUs round-robin: party j (the server is party 0, then the
# clients in order) gets the overrides `use_gpu True device GPUS[j mod n]`, after those above. Without GPUS each
# party keeps the device of its yaml.
# DRY_RUN=1 prints each party's command, one shell-quoted line per party (its device and key option included),
# and exits 0 without creating $LOGDIR or any key and without starting anything.
set -euo pipefail
PY=${PYTHON:-python3}
LOGDIR=${LOGDIR:-exp/distributed_logs}
JOIN_WAIT=${JOIN_WAIT:-8}
AUTH=${AUTH:-1}
TLS=${TLS:-0}
DRY_RUN=${DRY_RUN:-0}
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
# FS's parse_client_cfg takes any word beginning with "client" (and the next) for the client config, values too:
# write such a value as a Python string literal, which FS reads back as the same string (research/harness/fs_command.py)
for k in "${!opts[@]}"; do
  if (( k % 2 )) && [[ ${opts[k]} == client* ]]; then opts[k]="'${opts[k]}'"; fi
done
if [ ${#cfgs[@]} -lt 2 ]; then
  echo "usage: $0 SERVER.yaml CLIENT.yaml [CLIENT.yaml ...] [-- KEY VALUE ...]" >&2
  exit 2
fi
if [ "$DRY_RUN" != 0 ] && [ "$DRY_RUN" != 1 ]; then
  echo "$0: DRY_RUN must be 0 or 1, got '$DRY_RUN'" >&2
  exit 2
fi
gpus=()  # the devices of GPUS, in order; empty: each party keeps the device of its yaml
if [ -n "${GPUS+set}" ]; then
  if ! [[ $GPUS =~ ^[0-9]{1,6}(,[0-9]{1,6})*$ ]]; then
    echo "$0: GPUS must be comma-separated non-negative integers (e.g. GPUS=0,1,2,3), got '$GPUS'" >&2
    exit 2
  fi
  IFS=, read -r -a gpus <<<"$GPUS"
  for k in "${!gpus[@]}"; do gpus[k]=$((10#${gpus[k]})); done  # 01 -> 1: FS reads the value as a Python literal
fi
keys="$LOGDIR/keys"
certs=$TLS
[ "$TLS" = 1 ] && certs="$LOGDIR/certs"
# party i's command: the common overrides, then its key option (AUTH=1), its TLS files (TLS), its device (GPUS)
party_cmd() {
  local i=$1
  cmd=("$PY" -m federatedscope.main --cfg "${cfgs[$i]}" ${opts[@]+"${opts[@]}"})
  if [ "$AUTH" = 1 ]; then
    if [ "$i" -eq 0 ]; then cmd+=(fedpa.net.auth_keyring "$keys/keyring"); else cmd+=(fedpa.net.auth_key "$keys/client_$i.key"); fi
  fi
  if [ "$TLS" != 0 ]; then
    local own=server
    [ "$i" -eq 0 ] || own="client_$i"
    cmd+=(fedpa.net.tls_cert "$certs/$own.pem" fedpa.net.tls_key "$certs/$own.key" fedpa.net.tls_ca "$certs/ca.pem")
  fi
  if [ ${#gpus[@]} -gt 0 ]; then cmd+=(use_gpu True device "${gpus[i % ${#gpus[@]}]}"); fi
}
# "party i (server|client i[, device k])"
party_name() {
  local i=$1 role="client $1"
  [ "$i" -eq 0 ] && role=server
  if [ ${#gpus[@]} -gt 0 ]; then role+=", device ${gpus[i % ${#gpus[@]}]}"; fi
  echo "party $i ($role)"
}
if [ "$DRY_RUN" = 1 ]; then
  for i in "${!cfgs[@]}"; do
    party_cmd "$i"
    printf '%q ' "${cmd[@]}"
    printf '# %s\n' "$(party_name "$i")"
  done
  exit 0
fi
mkdir -p "$LOGDIR"
if [ "$AUTH" = 1 ]; then
  mkdir -p "$keys"
  chmod 700 "$keys"
  : >"$keys/keyring"
  chmod 600 "$keys/keyring"
  for ((i = 1; i < ${#cfgs[@]}; i++)); do
    key=$("$PY" -c "import secrets; print(secrets.token_hex(32))")
    (umask 077 && echo "$key" >"$keys/client_$i.key")
    echo "$i $key" >>"$keys/keyring"
  done
fi
if [ "$TLS" = 1 ]; then
  rm -rf "$certs"  # a fresh CA for each run, as the keys above
  "$PY" -m fs_fedpa.tools.make_certs "$certs" --clients $((${#cfgs[@]} - 1))
fi
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for i in "${!cfgs[@]}"; do
  party_cmd "$i"
  "${cmd[@]}" >"$LOGDIR/party$i.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  echo "[run_distributed] $(party_name "$i") ${cfgs[$i]}: pid $pid, log $LOGDIR/party$i.log"
  sleep "$JOIN_WAIT"
done
status=0
for p in "${pids[@]}"; do
  wait "$p" || { s=$?; [ $status -eq 0 ] && status=$s; }
done
trap - EXIT
echo "[run_distributed] all parties finished (status $status)"
exit $status
