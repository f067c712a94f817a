"""What benchmarks/step_sampler recorded, per process that ran at least
three optimizer steps: per step, its wall time, the main thread's CPU time,
the process's, the gc passes, the allocator's counters' change (retries,
cudaMalloc and cudaFree calls) and the innermost frames its samples were in.

    python benchmarks/step_sampler_report.py PROF_OUT
"""

import collections
import glob
import sys

STEP_MARK = ("adamw.py:step", "adam.py:step", "sgd.py:step")
STATS = ("retries", "dev_alloc", "dev_free", "reserved", "allocated", "sync_all")


def load(path):
    keys, samples, argv, mem, gcs = {}, [], "", [], []
    for line in open(path, errors="replace"):
        parts = line.rstrip("\n").split("\t")
        try:
            if parts[0] == "K" and len(parts) == 3:
                keys[int(parts[1])] = parts[2].split("|")
            elif parts[0] == "S" and len(parts) == 5:
                samples.append((float(parts[1]), float(parts[2]), int(parts[3]), float(parts[4])))
            elif parts[0] == "A":
                argv = "\t".join(parts[1:])
            elif parts[0] == "M" and len(parts) == 8:
                mem.append((float(parts[1]), [int(x) for x in parts[2:]]))
            elif parts[0] == "G" and len(parts) == 4:
                gcs.append((float(parts[1]), float(parts[2]), parts[3]))
        except ValueError:
            pass
    return keys, samples, argv, mem, gcs


def at(mem, t):
    best = None
    for when, values in mem:
        if when <= t:
            best = values
    return best


def main(folder, top=6):
    for path in sorted(glob.glob(folder + "/prof-*.txt")):
        keys, samples, argv, mem, gcs = load(path)
        in_opt = [any(frame in STEP_MARK for frame in keys.get(s[2], [])) for s in samples]
        ends = [k for k in range(1, len(samples)) if in_opt[k - 1] and not in_opt[k]]
        if len(ends) < 3:
            continue
        print(f"== {path} steps {len(ends)} argv {argv[:400]}")
        for a, b in zip(ends, ends[1:]):
            t0, t1 = samples[a][0], samples[b][0]
            wall = t1 - t0
            cpu = samples[b][1] - samples[a][1]
            pcpu = samples[b][3] - samples[a][3]
            gct = sum(took for start, took, _ in gcs if t0 <= start < t1)
            gcn = [g for start, _, g in gcs if t0 <= start < t1]
            m0, m1 = at(mem, t0), at(mem, t1)
            delta = [y - x for x, y in zip(m0, m1)] if m0 and m1 else None
            leaf = collections.Counter("|".join(keys.get(s[2], ["?"])[:2]) for s in samples[a:b])
            n = max(1, b - a)
            print(
                f"  step wall {wall:.3f} cpu {cpu:.3f} proc {pcpu:.3f} gc {gct * 1000:.1f}ms {gcn} "
                f"mem {dict(zip(STATS, delta)) if delta else None} res {m1[3] if m1 else None}"
            )
            print("     " + "; ".join(f"{100 * c / n:.0f}% {k}" for k, c in leaf.most_common(top)))


if __name__ == "__main__":
    main(sys.argv[1])
