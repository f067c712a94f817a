export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
SECONDS=0
timeout 170 python -m pytest -q -s -m gpu tests/gpu/test_replay_gpu.py tests/gpu/test_cuda_capture.py > $OUT/r/gputests.log 2>&1
echo "gpu tests rc $? in $SECONDS s"; tail -3 $OUT/r/gputests.log
left=$((280 - SECONDS))
timeout $left python benchmarks/corpus_by_hand.py --device cuda --device-memory 16GiB --cases dcgan > $OUT/r/dcgan.md 2>&1
echo "dcgan rc $? at $SECONDS s"; tail -8 $OUT/r/dcgan.md
cd $OUT && tar czf r.tgz r && rm -rf r
