#!/usr/bin/env bash
# Issue 59's central anchors on a lent GPU, side by side: one client holding all of SST-2's 67,349 training
# sentences, FedIT (with one client, plain central training), MiniLM with LoRA r = 4 and the head, AdamW 1e-3,
# b = 1,024, 18 rounds of 10 steps (about 2.7 epochs), dev accuracy (872 sentences); with DP-SGD at epsilon 8
# (Poisson, add/remove, PLD, C = 1) and without. Needs the folder of `gpu_check --prepare DIR --train-lines 0`
# (docs/gpu.md) in $CARRY (default .gpu); results in $OUT. Record: docs/reference/dp_anchors/central_sst2_h200.json.
set -u
OUT=${OUT:-/tmp/out}
CARRY=${CARRY:-.gpu}
common=(data.root "$CARRY/glue" use_gpu True device 0 federate.method fedit federate.client_num 1
  federate.sample_client_num 1 federate.total_round_num 18 federate.save_to "''" data.splitter iid
  dataloader.batch_size 1024 train.local_update_steps 10 train.optimizer.lr 0.001 eval.freq 6 fedpa.num_threads 4
  fedpa.records.diagnostics full)
dp=(model.seqcls.pack_len 0 early_stop.patience 0 fedpa.dp.mode sample fedpa.dp.clip 1.0 fedpa.dp.epsilon 8 fedpa.dp.sampling poisson fedpa.dp.accountant pld)
start=$(date +%s)
launch() {
  local name=$1; shift
  timeout 420 research/scripts/gpu_host.sh "$CARRY" -- python3 -m federatedscope.main --cfg yaml_configs/fedpa_sst2_minilm_cpu.yaml \
    outdir "$OUT/$name" expname "$name" "${common[@]}" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? after $(( $(date +%s) - start )) s"
}
launch central_nodp &
sleep 40  # the first call installs the wheels and widens MiniLM; the second finds them
launch central_dp "${dp[@]}" &
wait
for name in central_nodp central_dp; do
  grep -a "'Role': 'Server #'" "$OUT/$name/$name/exp_print.log" | tail -n 2 | cut -c1-400
  grep -a "Results_raw\|differential privacy" "$OUT/$name.log" | tail -n 2 | cut -c1-300
  tail -n 1 "$OUT/$name/$name/fedpa_privacy.jsonl" 2>/dev/null | cut -c1-700
  grep -a "Traceback\|Error" "$OUT/$name.log" | tail -n 3
done
find "$OUT" -name "*.pt" -delete; find "$OUT" -name "*ckpt*" -delete
