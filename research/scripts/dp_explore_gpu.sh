#!/usr/bin/env bash
# Issue 59, exploratory (one seed, untuned, not a protocol stage): the protocol's federation (10 clients, LDA 0.5)
# at b = 256, 2 local steps, 30 rounds, AdamW 1e-3; FedIT and FedPA-LoRA, with DP-SGD at epsilon 8 (Poisson,
# add/remove, PLD, C = 1, local heads frozen (the
# plain heads it first ran with broke the guarantee), clients under 1,000 sentences sitting out) and without.
set -u
OUT=${OUT:-/tmp/out}
CARRY=${CARRY:-.gpu}
common=(data.root "$CARRY/glue" use_gpu True device 0 federate.total_round_num 30 dataloader.batch_size 256
  train.local_update_steps 2 train.optimizer.lr 0.001 eval.freq 10 fedpa.num_threads 2)
dp=(fedpa.dp.mode sample fedpa.dp.clip 1.0 fedpa.dp.epsilon 8 fedpa.dp.sampling poisson fedpa.dp.accountant pld
  fedpa.dp.local_tensors frozen fedpa.dp.min_records 1000)
start=$(date +%s)
launch() {
  local name=$1 method=$2; shift 2
  timeout 330 research/scripts/gpu_host.sh "$CARRY" -- python3 -m federatedscope.main --cfg yaml_configs/compare_sst2_protocol.yaml \
    outdir "$OUT/$name" expname "$name" federate.method "$method" "${common[@]}" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? after $(( $(date +%s) - start )) s"
}
launch fedit_nodp fedit &
sleep 40  # the first call installs the wheels and widens MiniLM; the others find them
launch fedpa_nodp fedpa &
launch fedit_dp fedit "${dp[@]}" &
launch fedpa_dp fedpa "${dp[@]}" &
wait
for name in fedit_nodp fedpa_nodp fedit_dp fedpa_dp; do  # 8 files come back: each run's log and its results
  cat "$OUT/$name/$name/eval_results.log" "$OUT/$name/$name/fedpa_privacy.jsonl" >"$OUT/$name.results" 2>/dev/null
  grep -a "differential privacy\|Traceback\|Error" "$OUT/$name.log" | tail -n 2 | cut -c1-300
  rm -rf "${OUT:?}/$name"
done
