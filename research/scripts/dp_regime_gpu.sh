#!/usr/bin/env bash
# Issue 59's dpregime stage (research/study/sst2_dp_regime.py) on a lent GPU: the protocol's own runner, every decided run
# side by side (one thread each), for at most $LIMIT seconds; the stage's run files that finished come back as one
# archive in $OUT (the device returns few files), to be unpacked into docs/reference/sst2_protocol/runs/ here and
# committed. A run cut short by the limit leaves nothing; the stage resumes on any host. Needs the folder of
# `gpu_check --prepare DIR --train-lines 0` (docs/gpu.md) in $CARRY (default .gpu).
set -u
OUT=${OUT:-/tmp/out}
CARRY=${CARRY:-.gpu}
LIMIT=${LIMIT:-520}
JOBS=${JOBS:-16}
start=$(date +%s)
timeout --kill-after 5 "$LIMIT" research/scripts/gpu_host.sh "$CARRY" -- python3 -m research.study.sst2_compare \
  --data "$CARRY/glue" --work /tmp/dpregime_work --stage dpregime --jobs "$JOBS" use_gpu True device 0 \
  >"$OUT/runner.log" 2>&1
echo "runner rc=$? after $(( $(date +%s) - start )) s"
pkill -f federatedscope.main || true
tar czf "$OUT/dpregime_runs.tgz" -C docs/reference/sst2_protocol/runs dpregime 2>/dev/null
tar tzf "$OUT/dpregime_runs.tgz" 2>/dev/null | grep -c json
grep -a "Traceback\|Error\|failed" "$OUT/runner.log" | tail -n 5 | cut -c1-300
for log in /tmp/dpregime_work/dpregime/*/fs.log; do  # the runs cut short: their last round
  [ -e "$log" ] && echo "$(basename "$(dirname "$log")"): $(grep -ac 'Starting' "$log") rounds started;" \
    "$(grep -a 'Error' "$log" | tail -n 1 | cut -c1-200)"
done | tail -n 40
tail -n 3 "$OUT/runner.log" | cut -c1-300
