#!/usr/bin/env python3
"""Why the longest kernels take their time, from an Nsight Compute report's metrics
(`ncu --import R --page raw --csv --print-units base`, scripts/gpu_check.sh's stalls step): per kernel,
over its profiled launches, the time, the SM's and the memory's throughput as shares of the GPU's peak,
the warps active as a share of what an SM holds (achieved occupancy), the registers a thread, and the
warp states that held each issued instruction longest (cycles an instruction, WarpStateStats).

  scripts/ncu_stalls.py REPORT.csv [--json FILE]
  scripts/ncu_stalls.py --pick KERNELS.json [--top N]

--pick reads kernel_times.py's --json (the profile step's kernels.json) and prints, for ncu's
--kernel-name-base demangled --kernel-name regex:..., the launches a step of its N longest kernels
(default 5) and a regular expression that matches their names alone.

Reads the raw page's layout (a column a metric, a row of units under the header) and the details
page's (a row a metric); prints a row a kernel, longest first; exits 1 when no launch has a duration."""
import argparse, collections, csv, json, os, re, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_times import UNITS, short, table  # noqa: E402

DURATION = ("gpu__time_duration.sum", "Duration")  # the raw metric's name, then the details page's
SHARES = {  # key: (raw name, details page name)
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "Compute (SM) Throughput"),
    "memory_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "Memory Throughput"),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", "Achieved Occupancy"),
    "registers": ("launch__registers_per_thread", "Registers Per Thread"),
}
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(path):
    """[(kernel name, {metric: (value, unit)})], one a profiled launch, in the file's order."""
    rows = list(csv.reader(table(path)))
    if not rows:
        return []
    header = rows[0]
    name = next((c for c in ("Kernel Name", "Function Name", "Name") if c in header), None)
    if name is None:
        return []
    at = {c: i for i, c in enumerate(header)}
    out = collections.OrderedDict()
    if "Metric Name" in at:  # the details page: a row a metric
        for r in rows[1:]:
            if len(r) != len(header):
                continue
            _, metrics = out.setdefault(r[at["ID"]], (r[at[name]], {}))
            metrics.setdefault(r[at["Metric Name"]], (number(r[at["Metric Value"]]), r[at.get("Metric Unit", 0)]))
    else:  # the raw page: a column a metric, the units in the row under the header
        units = rows[1] if len(rows) > 1 else []
        for r in rows[2:]:
            if len(r) != len(header) or len(units) != len(header):
                continue
            out[r[at["ID"]]] = (r[at[name]], {c: (number(r[i]), units[i]) for i, c in enumerate(header)})
    return list(out.values())


def pick(metrics, names):
    for n in names:
        if n in metrics and metrics[n][0] is not None:
            return metrics[n]
    return None


def summary(path):
    kernels = collections.OrderedDict()
    for kernel, metrics in launches(path):
        d = pick(metrics, DURATION)
        if d is None or UNITS.get(d[1].strip()) is None:
            continue
        k = kernels.setdefault(short(kernel), {"launches": 0, "us": 0.0, "sums": collections.defaultdict(list)})
        k["launches"] += 1
        k["us"] += d[0] * UNITS[d[1].strip()]
        for key, names in SHARES.items():
            v = pick(metrics, names)
            if v is not None:
                k["sums"][key].append(v[0])
        for m, (v, _) in metrics.items():
            s = STALL.match(m)
            if s and v is not None:
                k["sums"]["stall:" + s.group(1)].append(v)
    rows = []
    for kernel, k in kernels.items():
        mean = {key: sum(v) / len(v) for key, v in k["sums"].items()}
        stalls = sorted(((key[6:], v) for key, v in mean.items() if key.startswith("stall:")), key=lambda s: -s[1])
        row = {"name": kernel, "launches": k["launches"], "us": k["us"], "stalls": [[s, round(v, 2)] for s, v in stalls]}
        row.update({key: mean.get(key) for key in SHARES})
        rows.append(row)
    rows.sort(key=lambda r: -r["us"])
    return rows


def cell(v, fmt):
    return format(v, fmt) if v is not None else "?".rjust(int(fmt.split(".")[0] or 0))


def pick_kernels(path, top):
    """'LAUNCHES REGEX': the launches a step of the `top` longest kernels, and a pattern of their names
    (as kernel_times.py wrote them: cut at 90 characters, so each is matched as a part of the name)."""
    with open(path) as f:
        kernels = json.load(f)["kernels"][:top]
    names = sorted({k["name"].removesuffix("...") for k in kernels})
    pattern = "|".join(re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", n) for n in names)
    return f"{round(sum(k['calls'] for k in kernels))} .*({pattern}).*"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", nargs="?")
    p.add_argument("--json")
    p.add_argument("--pick", metavar="KERNELS.json")
    p.add_argument("--top", type=int, default=5)
    a = p.parse_args()
    if a.pick:
        return print(pick_kernels(a.pick, a.top))
    if not a.report:
        p.error("give the report's CSV, or --pick")
    rows = summary(a.report)
    if not rows:
        sys.exit(f"ncu_stalls.py: no kernel launch with a duration in {a.report} (not ncu's --csv raw or details page?)")
    print(f"{'us':>8} {'calls':>5} {'SM %':>5} {'mem %':>5} {'occ %':>5} {'regs':>4}  kernel: the longest warp states, cycles an instruction")
    for r in rows:
        stalls = ", ".join(f"{s} {v:.1f}" for s, v in r["stalls"][:3]) or "?"
        print(f"{r['us']:8.1f} {r['launches']:5d} {cell(r['sm_pct'], '5.1f')} {cell(r['memory_pct'], '5.1f')} "
              f"{cell(r['occupancy_pct'], '5.1f')} {cell(r['registers'], '4.0f')}  {r['name']}: {stalls}")
    print("the longest: " + "; ".join(
        f"{r['name'].replace('dp::<unnamed>::', '')[:40]} {r['us']:.1f} us, SM {cell(r['sm_pct'], '.0f')}%, occupancy {cell(r['occupancy_pct'], '.0f')}%"
        + "".join(f", {s} {v:.1f}" for s, v in r["stalls"][:2]) for r in rows[:3]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernels": rows}, f, indent=2)


if __name__ == "__main__":
    main()
