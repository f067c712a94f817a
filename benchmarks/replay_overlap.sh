#!/bin/bash
# Whole `oomdoc run`s of the Hugging Face GPT-2-medium Trainer at 16 GiB, with
# replays side by side sharing the device (OOMDOC_REPLAY_OVERLAP=1) and one
# at a time on it (=0), and whether the answers are identical:
#   CASES="hf16 hf32" MODES="1 0" bash benchmarks/replay_overlap.sh
# Results go to $OUT (snapshots, logs, times.txt).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/overlap}; mkdir -p "$OUT"
CASES=${CASES:-hf16 hf32}; MODES=${MODES:-1 0}; LIMIT=${LIMIT:-170}
HF16="tests/scripts/fw_hf_trainer.py --use_cpu False --n_layer 24 --n_embd 1024 --seq_len 512 --vocab_size 50257 --per_device_train_batch_size 16 --max_steps 6"
HF32="benchmarks/scripts/hf_trainer_gpt2.py --preset medium --seq-len 512 --per_device_train_batch_size 32 --max_steps 6"
for mode in $MODES; do for case in $CASES; do
  args=$([ "$case" = hf16 ] && echo "$HF16" || echo "$HF32")
  start=$SECONDS
  OOMDOC_REPLAY_OVERLAP=$mode timeout "$LIMIT" python -m oomdoc run --device-memory 16GiB \
    --replay-jobs 3 -o "$OUT/$case-$mode.json" $args > "$OUT/$case-$mode.log" 2>&1
  echo "$case overlap=$mode exit $? in $((SECONDS - start)) s" | tee -a "$OUT/times.txt"
done; done
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
def key(d):
    p = d.get("prescription") or {}
    return (d.get("max_batch_size"), [(f["name"], f["fits"], f.get("peak_allocated_bytes")) for f in d.get("fixes") or []],
            p.get("fixes"), p.get("batch_size"), p.get("accumulation_steps"), p.get("peak_allocated_bytes"))
for case in ("hf16", "hf32"):
    runs = {m: load(f"{case}-{m}.json") for m in ("1", "0")}
    if runs["1"] and runs["0"]:
        print(case, "IDENTICAL" if key(runs["1"]) == key(runs["0"]) else "DIFFERENT")
    for m, d in runs.items():
        if not d:
            continue
        r = d.get("replay") or {}
        print(f"{case} overlap={m}: key {key(d)}; failing run {d.get('timings')}; replays {r.get('replays')} in {r.get('total_s')} s")
        for x in r.get("runs", []):
            print("   ", x["label"][:60], x["outcome"], "wall", x["wall_s"], "start", x.get("started_s"), "lock", x.get("lock_wait_s"), "script", x.get("script_s"), "again" if x.get("timed_again_alone") else "")
        print("    step_time_ratio", [(f["name"], f.get("step_time_ratio")) for f in d.get("fixes") or []])
PY
