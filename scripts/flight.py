#!/usr/bin/env python3
"""Every rank's flight records side by side, the first divergence marked.

    scripts/flight.py DIR [--last N]

DIR is where the ranks of a failed job wrote rank<R>.json (the path its error message printed;
engine/flight_recorder.h). For each channel (a local device's, or the host's), the collectives by
sequence number, one column per rank: kind, bytes and state. A row where the ranks differ (another
kind or size, done on one and pending on another, begun on one and never on another) is a
divergence, as is a collective unfinished on some rank (pending, timed out); the first is marked '>>'
and shown with the rows before it. A rank with no file wrote
none: it was stopped or killed before it could.
"""
import argparse
import glob
import json
import os
import re
import sys


def load(directory):
    ranks = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        m = re.fullmatch(r"rank(\d+)\.json", os.path.basename(path))
        if m:
            with open(path) as f:
                ranks[int(m.group(1))] = json.load(f)
    return ranks


def cell(rec, wrote=True):
    if not wrote:
        return "(no file)"
    if rec is None:
        return "-"
    return f"{rec['kind']} {rec['bytes']:,} B {rec['state']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--last", type=int, default=6, help="rows shown before the first divergence (default 6)")
    a = ap.parse_args()
    ranks = load(a.dir)
    if not ranks:
        sys.exit(f"flight.py: {a.dir}: no rank<R>.json here; give the directory the job's error message printed")
    size = max(r["size"] for r in ranks.values())
    print(f"flight records in {a.dir}, {len(ranks)} of {size} ranks:")
    for r in range(size):
        j = ranks.get(r)
        print(f"  rank {r}: " + (f"{j['host']}, {j['why']}, {len(j['records'])} records" if j
                                 else "no file (stopped or killed before it could write one)"))
    channels = sorted({rec["channel"] for j in ranks.values() for rec in j["records"]})
    found = False
    for ch in channels:
        # Each rank's records of the channel by seq, and the range of seqs its buffer still covers.
        by = {r: {rec["seq"]: rec for rec in j["records"] if rec["channel"] == ch} for r, j in ranks.items()}
        seqs = sorted({s for recs in by.values() for s in recs})
        first = max((min(recs) for recs in by.values() if recs), default=0)  # every kept buffer reaches here
        rows, diverged = [], None
        for s in seqs:
            if s < first:
                continue
            recs = [by[r].get(s) if r in by else None for r in range(size)]
            rows.append((s, recs))
            # Among the ranks that wrote a file: another kind, size or state, or not begun on one.
            keys = {(x["kind"], x["bytes"], x["state"]) if x else None for r, x in enumerate(recs) if r in by}
            unfinished = [f"rank {r}" for r, x in enumerate(recs) if x and x["state"] != "done"]
            if diverged is None and (len(keys) > 1 or unfinished):
                diverged = len(rows) - 1
                why = ("the ranks differ" if len(keys) > 1 else "unfinished on " + ", ".join(unfinished))
        name = "the host channel" if ch < 0 else f"channel {ch}"
        print(f"\n{name}:")
        width = max([len(cell(x)) for _, recs in rows for x in recs] + [10])
        wrote = [r in ranks for r in range(size)]
        print("   " + f"{'seq':>6} {'step':>6}  " + "  ".join(f"{'rank ' + str(r):<{width}}" for r in range(size)))
        # The last rows, or those before the first divergence and the one after it.
        lo, hi = (len(rows) - a.last, len(rows)) if diverged is None else (diverged - a.last, diverged + 2)
        for i in range(max(0, lo), min(hi, len(rows))):
            s, recs = rows[i]
            step = next(x["step"] for x in recs if x)
            mark = ">> " if i == diverged else "   "
            print(mark + f"{s:>6} {step:>6}  " + "  ".join(f"{cell(x, w):<{width}}" for x, w in zip(recs, wrote)))
        if diverged is not None:
            found = True
            silent = [f"rank {r}" for r in range(size) if r not in ranks]
            print(f"first divergence on {name}: seq {rows[diverged][0]}, {why}" +
                  (f" ({', '.join(silent)} wrote no file)" if silent else ""))
    if not found:
        print("\nno divergence: every rank's records agree where they overlap, and every collective finished")


if __name__ == "__main__":
    main()
