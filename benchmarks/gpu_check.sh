#!/bin/bash
# One GPU call that checks issues 11 and 12 within a device budget (BUDGET
# seconds, default 560): the whole runs (ResNet-50, Hugging Face Trainer,
# Lightning, the reference GPT) at 16 GiB, the by-hand runs of their
# prescriptions, the suite's overhead rows, the leak's whole run, then the GPU
# tests with what is left. Results go to $OUT/check (each part as it ends) and
# $OUT/check.tgz. Run from the repository root:  bash benchmarks/gpu_check.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DIR=${OUT:-/tmp}/check; mkdir -p "$DIR"
SECONDS=0
BUDGET=${BUDGET:-560}
JOBS=${JOBS:-1}
left() { l=$((BUDGET - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
run() { name=$1; limit=$(left $2); shift 2; start=$SECONDS
  [ $limit -lt 20 ] && { echo "== $name skipped (out of time)"; return; }
  timeout $limit python -m oomdoc run --device-memory 16GiB --replay-jobs $JOBS -o "$DIR/$name.json" "$@" > "$DIR/$name.log" 2>&1
  echo "== $name exit $? in $((SECONDS-start)) s"; }
run hf 150 tests/scripts/fw_hf_trainer.py --use_cpu False --n_layer 24 --n_embd 1024 --seq_len 512 --vocab_size 50257 --per_device_train_batch_size 16 --max_steps 6
run resnet 90 benchmarks/scripts/resnet50_train.py --batch-size 512 --steps 6
run lightning 150 tests/scripts/fw_lightning_trainer.py --accelerator gpu --width 1024 --depth 12 --seq-len 512 --vocab-size 32000 --batch-size 256 --steps 6
run gpt 90 examples/gpt_train.py --batch-size 32 --steps 6
timeout $(left 200) python benchmarks/prescription_by_hand.py "$DIR" hf resnet lightning | tee "$DIR/byhand.txt"
l=$(left 260); [ $l -gt 60 ] && timeout $l python benchmarks/suite.py --device cuda --device-memory 16GiB --quick --no-whole-run > "$DIR/suite.txt" 2> "$DIR/suite.err"; echo "== suite at $SECONDS s"; cat "$DIR/suite.txt"
run keepleak 100 benchmarks/scripts/keep_features.py --steps 100000 --batch-size 4096 --inputs 1024 --width 2048
l=$(left 200); [ $l -gt 30 ] && timeout $l python -m pytest -q -x -m gpu tests/gpu/test_replay_gpu.py tests/gpu/test_cuda_capture.py > "$DIR/gputests.txt" 2>&1; echo "== gpu tests exit $? at $SECONDS s"; tail -3 "$DIR/gputests.txt"
[ -n "$OUT" ] && (cd "$OUT" && tar czf check.tgz --exclude="*.pickle" check && rm -rf check)
echo "total $SECONDS s"
