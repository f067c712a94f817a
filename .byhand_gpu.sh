cd $1
A="--n_layer=12 --n_embd=1024 --n_head=16 --block_size=512 --vocab_size=32000 --max_iters=3 --eval_interval=2 --eval_iters=2"
PYTHONPATH=$PWD timeout 200 python -m oomdoc run --device cuda --device-memory 16GiB --nproc-per-node 2 --no-replay -o /tmp/bh.json tests/corpus/gpt_configurator.py $A --dtype=bfloat16 --use_checkpoint=True --batch_size=48 > /tmp/bh.log 2>&1
echo rc=$?
python - <<'PY'
import json
d=json.load(open('/tmp/bh.json'))
for r in d['ranks']:
    print('rank', r['rank'], r['outcome'], 'oom', {k: r['oom'].get(k) for k in ('step','phase','allocated_bytes','reserved_bytes','requested_bytes')} if r.get('oom') else None)
    for s in r['steps']:
        print('  step', s['index'], s['peak_allocated_bytes'], s['peak_reserved_bytes'], s.get('phase_peaks'), s.get('evaluation_calls'), s.get('forward_calls'), s.get('optimizer_steps'))
PY
grep -n "Error\|error" /tmp/bh.log | head -5
