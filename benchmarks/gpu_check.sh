#!/bin/bash
# GPU checks for issues 11 and 12 within a device budget (BUDGET seconds,
# default 560, under the device's 600 s per call), in parts (PARTS, default
# all of them; one call rarely fits them all):
#   runs     the whole runs at 16 GiB (HF Trainer, ResNet-50, Lightning, the
#            reference GPT), each with --replay-jobs $JOBS (default 1)
#   byhand   the prescriptions of those runs, run by hand with the script's flags
#   suite    the suite's capture-overhead rows (benchmarks/suite.py)
#   host     the capture's host time per step (benchmarks/host_overhead.py)
#   leak     the feature-keeping leak's whole run
#   tests    the GPU tests (tests/gpu/test_replay_gpu.py, test_cuda_capture.py)
#   capture  ResNet-50's capture cost: host time per hook (hook_time.py) and
#            8 interleaved rounds, plain against oomdoc (capture_parts.py)
#   sweeps   the ImageNet-style trainer's dense sweep by hand (configuration_sweep.py)
#            against its diagnosis (the GPT's and Lightning's: README)
#   stability  the ImageNet-style trainer and the Lightning encoder diagnosed
#            again and again (stability.py; 3 runs each within one call)
# Results go to $OUT/check (each part as it ends) and $OUT/check.tgz. E.g.
#   PARTS="runs byhand" JOBS=3 bash benchmarks/gpu_check.sh
#   PARTS="suite host leak tests" bash benchmarks/gpu_check.sh
# (runs before byhand in one call, or the same $OUT/check kept between calls).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DIR=${OUT:-/tmp}/check; mkdir -p "$DIR"
SECONDS=0
BUDGET=${BUDGET:-560}
JOBS=${JOBS:-1}
PARTS=${PARTS:-runs byhand suite host leak tests}
want() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
left() { l=$((BUDGET - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
run() { name=$1; limit=$(left $2); shift 2; start=$SECONDS
  [ $limit -lt 20 ] && { echo "== $name skipped (out of time)"; return; }
  timeout $limit python -m oomdoc run --device-memory 16GiB --replay-jobs $JOBS -o "$DIR/$name.json" "$@" > "$DIR/$name.log" 2>&1
  echo "== $name exit $? in $((SECONDS-start)) s"; }
want runs && run hf 130 tests/scripts/fw_hf_trainer.py --use_cpu False --n_layer 24 --n_embd 1024 --seq_len 512 --vocab_size 50257 --per_device_train_batch_size 16 --max_steps 6
want runs && run resnet 80 benchmarks/scripts/resnet50_train.py --batch-size 512 --steps 6
want runs && run lightning 130 tests/scripts/fw_lightning_trainer.py --accelerator gpu --width 1024 --depth 12 --seq-len 512 --vocab-size 32000 --batch-size 256 --steps 6
want runs && run gpt 80 examples/gpt_train.py --batch-size 32 --steps 6
want byhand && timeout $(left 170) python benchmarks/prescription_by_hand.py "$DIR" hf resnet lightning | tee "$DIR/byhand.txt"
want suite && { l=$(left 260); [ $l -gt 60 ] && timeout $l python benchmarks/suite.py --device cuda --device-memory 16GiB --quick --no-whole-run > "$DIR/suite.txt" 2> "$DIR/suite.err"; echo "== suite at $SECONDS s"; cat "$DIR/suite.txt"; }
want host && timeout $(left 120) python benchmarks/host_overhead.py --model hf --device cuda > "$DIR/host.txt" 2>&1; want host && cat "$DIR/host.txt"
want leak && run keepleak 100 benchmarks/scripts/keep_features.py --steps 100000 --batch-size 4096 --inputs 1024 --width 2048
want tests && { l=$(left 200); [ $l -gt 30 ] && timeout $l python -m pytest -q -x -m gpu tests/gpu/test_replay_gpu.py tests/gpu/test_cuda_capture.py > "$DIR/gputests.txt" 2>&1; echo "== gpu tests exit $? at $SECONDS s"; tail -3 "$DIR/gputests.txt"; }
RESNET="benchmarks/scripts/resnet50_train.py --batch-size 128 --steps 40"
want capture && { timeout $(left 60) python benchmarks/hook_time.py --device-memory 16GiB -- $RESNET > "$DIR/hook_time.txt" 2>&1; head -12 "$DIR/hook_time.txt"; grep "outermost" "$DIR/hook_time.txt"; }
want capture && { l=$(left 330); [ $l -gt 120 ] && timeout $l python benchmarks/capture_parts.py --device-memory 16GiB --repeats 8 --variant "oomdoc=" -- $RESNET > "$DIR/capture_parts.txt" 2>&1; tail -4 "$DIR/capture_parts.txt"; }
IMAGENET="tests/corpus/imagenet_style.py -b 1024 -j 2 --image-size 160 --width 64 --train-samples 8192 --val-samples 512"
LIGHTNING="tests/scripts/fw_lightning_trainer.py --accelerator gpu --width 1024 --depth 12 --seq-len 512 --vocab-size 32000 --batch-size 256 --steps 6"
want sweeps && { timeout $(left 120) python -m oomdoc run --device-memory 16GiB -o "$DIR/imagenet.json" $IMAGENET > "$DIR/imagenet.log" 2>&1; echo "== imagenet diagnosis (default lanes) at $SECONDS s"; timeout $(left 240) python benchmarks/configuration_sweep.py --device-memory 16GiB --batch-flag=-b --accumulation-flag=--grad-accum-steps --saver "autocast=--amp" --saver "checkpointing=--checkpoint" --batches 512,256,128 --snapshot "$DIR/imagenet.json" --out "$DIR/sweep-imagenet" -- $IMAGENET > "$DIR/sweep-imagenet.txt" 2>&1; tail -18 "$DIR/sweep-imagenet.txt"; }
want stability && for case in IMAGENET LIGHTNING; do timeout $(left 280) python benchmarks/stability.py --runs 3 --device-memory 16GiB --out "$DIR/stability-$case" -- ${!case} > "$DIR/stability-$case.txt" 2>&1; tail -7 "$DIR/stability-$case.txt"; done
[ -n "$OUT" ] && (cd "$OUT" && tar czf check.tgz --exclude="*.pickle" check && rm -rf check)
echo "total $SECONDS s"
