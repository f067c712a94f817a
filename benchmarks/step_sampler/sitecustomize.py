"""A sampler of every Python process's main thread, for telling where a
step's time goes in oomdoc's children against a plain run (README: the
replays' step times): the main thread's stack every 2 ms with its CPU
clock and the process's, gc passes, and (every 10th sample, once CUDA is
up) the allocator's counters, appended to $PROF_OUT/prof-<pid>.txt.

Put this folder first on PYTHONPATH, with PROF_OUT set, and every process
started from there imports it (forked children start it again):

    PROF_OUT=/tmp/prof PYTHONPATH=$PWD/benchmarks/step_sampler:$PWD \
        python -m oomdoc run --device-memory 16GiB SCRIPT ARGS
    python benchmarks/step_sampler_report.py /tmp/prof

Not part of oomdoc, and nothing of it runs without PROF_OUT."""

import gc
import os
import sys
import threading
import time

OUT = os.environ.get("PROF_OUT")
STATS = (
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "reserved_bytes.all.current",
    "allocated_bytes.all.current",
    "num_sync_all_streams",
)


def _start():
    main = threading.get_ident()
    try:
        clock = time.pthread_getcpuclockid(main)
    except Exception:
        clock = None
    path = os.path.join(OUT, f"prof-{os.getpid()}.txt")
    keys = {}
    gcs = []
    gc_start = [0.0]

    def on_gc(phase, info):
        if threading.get_ident() != main:
            return
        if phase == "start":
            gc_start[0] = time.monotonic()
        else:
            gcs.append((gc_start[0], time.monotonic() - gc_start[0], info.get("generation")))

    gc.callbacks.append(on_gc)

    def loop():
        handle = open(path, "a", buffering=1 << 16)
        handle.write("A\t" + repr(sys.argv) + "\n")
        last = time.monotonic()
        count = 0
        while True:
            time.sleep(0.002)
            frame = sys._current_frames().get(main)
            if frame is None:
                handle.flush()
                return
            stack = []
            while frame is not None and len(stack) < 60:
                code = frame.f_code
                name = code.co_filename
                cut = name.rfind("/oomdoc/")
                name = name[cut + 1 :] if cut >= 0 else os.path.basename(name)
                stack.append(f"{name}:{code.co_name}")
                frame = frame.f_back
            key = "|".join(stack)
            index = keys.get(key)
            if index is None:
                index = keys[key] = len(keys)
                handle.write(f"K\t{index}\t{key}\n")
            now = time.monotonic()
            cpu = time.clock_gettime(clock) if clock is not None else 0.0
            handle.write(f"S\t{now:.4f}\t{cpu:.4f}\t{index}\t{time.process_time():.4f}\n")
            count += 1
            if count % 10 == 0:
                torch = sys.modules.get("torch")
                try:
                    if torch is not None and torch.cuda.is_initialized():
                        stats = torch.cuda.memory_stats()
                        counters = "\t".join(str(stats.get(k, -1)) for k in STATS)
                        handle.write(f"M\t{now:.4f}\t{counters}\n")
                except Exception:
                    pass
            while gcs:
                start, took, gen = gcs.pop(0)
                handle.write(f"G\t{start:.4f}\t{took:.5f}\t{gen}\n")
            if now - last > 0.25:
                last = now
                handle.write(
                    "A\t"
                    + repr(sys.argv)
                    + "\t"
                    + ",".join(t.name for t in threading.enumerate())
                    + "\n"
                )
                handle.flush()

    threading.Thread(target=loop, daemon=True, name="prof").start()


if OUT:
    os.makedirs(OUT, exist_ok=True)
    _start()
    os.register_at_fork(after_in_child=_start)
