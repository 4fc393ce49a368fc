#!/usr/bin/env python3
"""The GPU's time per kernel in one training step, from two runs of dp_train under Nsight Compute
(`ncu --metrics gpu__time_duration.sum --csv --log-file F`, scripts/gpu_check.sh's profile step): a short
run and a longer one, whose difference over the steps between them is the steady step alone (the start,
cuDNN's planning and the evaluation are in both and cancel).

  scripts/kernel_times.py SHORT.csv LONG.csv --steps N [--json FILE]

Prints one row per kernel (calls and microseconds a step, share of the step's kernel time), longest
first; exits 1 when either file holds no kernel times."""
import argparse, collections, csv, json, re, sys

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def short(name):
    """A kernel's name without its argument list and return type (templates kept, trimmed)."""
    name = re.sub(r"\(.*$", "", name.strip())
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= 90 else name[:87] + "..."


def table(path):
    """The lines of ncu's CSV from its header ("ID", ...) on, without ncu's own (==PROF==); [] if none."""
    with open(path, errors="replace") as f:
        lines = [l for l in f if not l.startswith("==")]
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    return [] if start is None else lines[start:]


def read(path):
    """name -> [launches, microseconds] over the whole run."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(table(path)):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNITS.get(row.get("Metric Unit", "").strip())
        try:
            value = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        if unit is None:
            continue
        k = out[short(row["Kernel Name"])]
        k[0] += 1
        k[1] += value * unit
    return dict(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("short")
    p.add_argument("long")
    p.add_argument("--steps", type=int, required=True, help="steps the long run has beyond the short one")
    p.add_argument("--json")
    a = p.parse_args()
    if a.steps < 1:
        sys.exit("kernel_times.py: --steps must be at least 1")
    s, l = read(a.short), read(a.long)
    if not s or not l:
        sys.exit(f"kernel_times.py: no kernel times in {a.short if not s else a.long} (not ncu --csv output?)")
    rows = []
    for name in l:
        calls = (l[name][0] - s.get(name, [0, 0.0])[0]) / a.steps
        us = (l[name][1] - s.get(name, [0, 0.0])[1]) / a.steps
        if calls > 0:
            rows.append({"name": name, "calls": calls, "us": us})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    launches = sum(r["calls"] for r in rows)
    print(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel  (ncu, gpu__time_duration.sum; a step = ({a.long} - {a.short}) / {a.steps})")
    for r in rows:
        print(f"{r['us']:9.1f} {100 * r['us'] / total if total else 0:5.1f}% {r['calls']:6.2f}  {r['name']}")
    print(f"{total:9.1f} 100.0% {launches:6.2f}  all kernels of one step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"total_us": total, "launches": launches, "steps": a.steps, "kernels": rows}, f, indent=2)


if __name__ == "__main__":
    main()
