#!/usr/bin/env python3
"""Plots for `dp_bench ... --plot DIR`: dp_bench writes DIR/KIND.json and runs

    python3 bench/plot.py KIND DIR/KIND.json DIR

KIND is compare, comm, skew, bn or scale. Prints the path of every PNG it writes, one a line. Needs only
matplotlib (Debian: python3-matplotlib); never needed to build, train or test.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1024.0 * 1024.0

# The engine's eight phases; the two strategies name two of them differently.
PHASES = [
    ("load", ("load",), "#9ecae1"),
    ("scatter", ("scatter",), "#fdae6b"),
    ("broadcast", ("broadcast",), "#fd8d3c"),
    ("forward", ("forward",), "#4292c6"),
    ("gather+loss | loss", ("gather+loss", "loss"), "#e6550d"),
    ("backward", ("backward",), "#08519c"),
    ("reduce | all-reduce", ("reduce", "all-reduce"), "#a63603"),
    ("optimizer", ("optimizer",), "#74c476"),
]

CATEGORY_COLORS = {
    "parameters": "#3182bd",
    "gradients": "#6baed6",
    "optimizer": "#31a354",
    "activations": "#bdbdbd",
    "inputs": "#e6550d",
    "outputs": "#fdae6b",
    "comm": "#756bb1",
    "workspace": "#636363",
    "gathered": "#e7298a",
}


def size_label(b):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:g}{unit}"
    return f"{b}B"


def device_kind(d):
    """What ran, from the record dp_bench wrote: "simulated CPU devices (sim:0,sim:1)" or "CUDA GPUs
    (cuda:0,cuda:1)", with the GPUs' names where the record has them. A plot seen out of context must
    not read as a GPU result when it was measured on simulated devices."""
    rec = d.get("config", d)  # compare and skew keep it in their config, comm at the top
    backend = rec.get("backend")
    names = rec.get("device_names") or d.get("names") or []
    where = f" ({','.join(names)})" if names else ""
    if backend == "cpu":
        return "simulated CPU devices" + where
    if backend == "cuda":
        gpus = rec.get("gpu_names") or d.get("gpu_names")
        return "CUDA GPUs" + (": " + ", ".join(dict.fromkeys(gpus)) if gpus else "") + where
    return f"devices of unrecorded kind (backend {backend!r}; simulated or CUDA unknown)" + where


def save(fig, out, name):
    """Writes the PNG, its titles also in its metadata (PNG text "Title"): the device kind travels
    with the file."""
    path = os.path.join(out, name)
    sup = getattr(fig, "_suptitle", None)
    titles = [t for t in [sup.get_text() if sup else ""] + [a.get_title() for a in fig.axes] if t]
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Title": " | ".join(titles)})
    plt.close(fig)
    print(path)


def compare(d, out):
    cfg = d["config"]
    bars = []  # (label, {slot: ms}, median step ms)
    for run in d["runs"]:
        for s in run["strategies"]:
            by_slot = {}
            for p in s["phases"]:
                for slot, names, _ in PHASES:
                    if p["phase"] in names:
                        by_slot[slot] = p["device0_ms"]
            label = s["strategy"] + (f"\n{run['devices']} device" + ("s" if run["devices"] > 1 else "") if len(d["runs"]) > 1 else "")
            bars.append((label, by_slot, s["step_ms"]["median"]))

    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(bars) + 2.5), 4.8))
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for slot, _, color in PHASES:
        h = [b[1].get(slot, 0.0) for b in bars]
        if not any(h):
            continue
        ax.bar(x, h, bottom=bottom, color=color, label=slot, width=0.6, edgecolor="white", linewidth=0.5)
        bottom = [bo + hi for bo, hi in zip(bottom, h)]
    ax.scatter(x, [b[2] for b in bars], marker="_", s=900, color="black", zorder=3, label="median step (wall)")
    for i, b in enumerate(bars):
        ax.annotate(f"{b[2]:.1f} ms", (i, max(bottom[i], b[2])), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=9)
    ax.set_xticks(list(x))
    ax.set_xticklabels([b[0] for b in bars])
    ax.set_ylabel("ms per step (device 0's phases)")
    n = d["runs"][0]["devices"] if len(d["runs"]) == 1 else None
    where = f", {n} devices" if n else ""
    ax.set_title(f"{cfg['model']}, global batch {cfg['batch']}{where}: time per step by phase\n{device_kind(d)}")
    ax.set_ylim(0, max(max(bottom), max(b[2] for b in bars)) * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    save(fig, out, "compare_phases.png")

    if "scaling" in d and len(d["scaling"]) > 1:
        sc = d["scaling"]
        fig, ax = plt.subplots(figsize=(6.0, 4.2))
        devs = [r["devices"] for r in sc]
        ax.plot(devs, [r["scatter_images_per_second"] for r in sc], "o-", color="#e6550d", label="scatter (DataParallel)")
        if all("naive_images_per_second" in r for r in sc):  # records before the naive column lack it
            ax.plot(devs, [r["naive_images_per_second"] for r in sc], "^-", color="#756bb1", label="naive (d2l allreduce)")
        ax.plot(devs, [r["allreduce_images_per_second"] for r in sc], "s-", color="#3182bd", label="allreduce (DDP)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(devs)
        ax.set_xticklabels([str(v) for v in devs])
        ax.set_xlabel("devices")
        ax.set_ylabel("images / s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{cfg['model']}, global batch {cfg['batch']}: throughput vs devices\n{device_kind(d)}")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
        save(fig, out, "compare_scaling.png")


def comm(d, out):
    pts = d["points"]
    names = []
    for p in pts:
        if p["collective"] not in names:
            names.append(p["collective"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.0, 4.4))
    for c in names:
        xs = [p["bytes"] for p in pts if p["collective"] == c]
        ax.plot(xs, [p["busbw_gbps"] for p in pts if p["collective"] == c], "o-", ms=3, label=c)
        ax2.plot(xs, [p["time_us"] for p in pts if p["collective"] == c], "o-", ms=3, label=c)
    ab = d.get("alpha_beta")
    if ab:
        ar = [p for p in pts if p["collective"] == "all_reduce"]
        model = [ab["alpha_us"] + p["rank_bytes"] / (ab["beta_gbps"] * 1e3) for p in ar]
        which = f" (median of {ab['repeats']} repeats)" if "repeats" in ab else ""
        ax2.plot([p["bytes"] for p in ar], model, "k--", lw=1,
                 label=f"all_reduce α-β{which}: α={ab['alpha_us']:.0f} µs, β={ab['beta_gbps']:.2f} GB/s")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        ticks = [p["bytes"] for p in pts if p["collective"] == names[0]][::3]
        a.set_xticks(ticks)
        a.set_xticklabels([size_label(t) for t in ticks], rotation=45)
        a.set_xlabel("message size S")
        a.grid(alpha=0.3, which="both")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"bus bandwidth, {d['devices']} devices")
    ax.legend(frameon=False, fontsize=9)
    ax2.set_yscale("log")
    ax2.set_ylabel("time per op (µs)")
    ax2.set_title("time per op")
    ax2.legend(frameon=False, fontsize=8)
    fig.suptitle(f"collectives on {device_kind(d)}")
    fig.tight_layout()
    save(fig, out, "comm_busbw.png")


def skew(d, out):
    strategies = [s for s in d["strategies"] if s["fits"]]
    if not strategies:
        return
    # What every replica holds at the bottom, what differs on top, so the skew is the top of the bar.
    order = ["activations", "workspace", "parameters", "gathered", "gradients", "optimizer", "outputs", "inputs", "comm"]
    cats = [c for c in order if c in d["config"]["categories"]] + [c for c in d["config"]["categories"] if c not in order]
    width = 5.5 if len(strategies) <= 2 else 3.6
    fig, axes = plt.subplots(1, len(strategies), figsize=(width * len(strategies), 4.6), sharey=True)
    if len(strategies) == 1:
        axes = [axes]
    top = 0
    for ax, s in zip(axes, strategies):
        devs = s["devices"]
        x = range(len(devs))
        bottom = [0.0] * len(devs)
        for c in cats:
            h = [dv["at_peak"][c] / MIB for dv in devs]
            if not any(h):
                continue
            ax.bar(x, h, bottom=bottom, color=CATEGORY_COLORS.get(c), label=c, width=0.6, edgecolor="white", linewidth=0.5)
            bottom = [bo + hi for bo, hi in zip(bottom, h)]
        top = max(top, max(bottom))
        for i, b in enumerate(bottom):
            ax.annotate(f"{b:.2f}", (i, b), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xticklabels([dv["name"] for dv in devs])
        ax.set_title(f"{s['strategy']}: skew {s['skew']:.3f}")
        ax.grid(axis="y", alpha=0.3)
    cap = d["config"].get("device_memory", 0)
    if cap:
        for ax in axes:
            ax.axhline(cap / MIB, color="red", ls="--", lw=1, label="--device-memory")
        top = max(top, cap / MIB)
    axes[0].set_ylabel("MiB at the device's peak")
    axes[0].set_ylim(0, top * 1.12)
    # Every category some strategy booked (zero3's gathered layers only there), in stacking order.
    legend = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    labels = [c for c in cats if c in legend] + [lb for lb in legend if lb not in cats]
    fig.legend([legend[lb] for lb in labels][::-1], labels[::-1], loc="center left", bbox_to_anchor=(1.0, 0.5),
               frameon=False, fontsize=9)
    cfg = d["config"]
    model = cfg["model"] + (f" at width {cfg['width']}" if cfg.get("width", 1) > 1 else "")
    optimizer = f", {cfg['optimizer']}" if "optimizer" in cfg else ""
    fig.suptitle(f"memory per device by category: {model}{optimizer}, global batch {cfg['batch']}\n{device_kind(d)}")
    fig.tight_layout()
    save(fig, out, "skew_memory.png")


def bn_devices(d):
    """bn's runs each have their own device count: the kind of device and the range of counts."""
    cfg = d["config"]
    counts = sorted({r["devices"] for r in d["runs"]} | {d["reference"]["devices"]})
    span = f"{counts[0]} to {counts[-1]}" if len(counts) > 1 else f"{counts[0]}"
    if cfg.get("backend") == "cpu":
        return f"simulated CPU devices ({span} of them, sim:0,sim:1,..., a CPU thread each)"
    if cfg.get("backend") == "cuda":
        return f"CUDA GPUs ({span} replicas, round-robin over the GPUs)"
    return f"devices of unrecorded kind (backend {cfg.get('backend')!r}; simulated or CUDA unknown)"


def bn(d, out):
    cfg = d["config"]
    ref = d["reference"]
    modes = [("local", "local BatchNorm (per-device statistics)", "o-", "#e6550d"),
             ("sync", "SyncBatchNorm (global-batch statistics)", "s-", "#3182bd")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.0, 4.6))
    ps = sorted({r["per_device"] for r in d["runs"]})
    floor = 1e-9  # sync's distance can be exactly 0, which a log axis cannot show
    for mode, label, style, color in modes:
        rows = sorted((r for r in d["runs"] if r["mode"] == mode), key=lambda r: r["per_device"])
        x = [r["per_device"] for r in rows]
        ax.plot(x, [r["test_accuracy"] for r in rows], style, color=color, label=label)
        ax2.plot(x, [max(r["running_distance"], floor) for r in rows], style, color=color, label=label)
    ax.axhline(ref["test_accuracy"], color="black", ls="--", lw=1,
               label=f"reference: 1 device, batch {ref['per_device']} ({ref['test_accuracy']:.4f})")
    # The reference and the sync runs are one computation up to float rounding: their spread is the noise.
    same = [ref["test_accuracy"]] + [r["test_accuracy"] for r in d["runs"] if r["mode"] == "sync"]
    ax.axhspan(min(same), max(same), color="#3182bd", alpha=0.12, lw=0,
               label="spread of sync and reference (float rounding)")
    labels = [f"{p}\n({cfg['batch'] // p} dev)" for p in ps]
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ps)
        a.set_xticklabels(labels)
        a.minorticks_off()
        a.set_xlabel("per-device batch (devices = global batch / per-device)")
        a.grid(alpha=0.3, which="both")
    ax.set_ylabel(f"test accuracy ({cfg['test_images']} images, running statistics)")
    ax.set_title("test accuracy")
    ax.legend(frameon=False, fontsize=8, loc="lower right")
    ax2.set_yscale("log")
    ax2.set_ylabel("||r - r_ref|| / ||r_ref||")
    ax2.set_title("running statistics' distance from the reference's")
    ax2.legend(frameon=False, fontsize=8)
    fig.suptitle(f"{cfg['model']}, global batch {cfg['batch']}, {cfg['steps']} steps, --sync {cfg['strategy']}: "
                 f"BatchNorm across replicas\n{bn_devices(d)}")
    fig.tight_layout()
    save(fig, out, "bn.png")


def scale(d, out):
    """dp_bench scale: the modelled step time and its exposed communication share against the device
    count, one line per strategy, log scale; the validation's measured steps (sim preset) as dots."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, s in enumerate(d["strategies"]):
        pts = s["points"]
        n = [p["devices"] for p in pts]
        color = f"C{i}"
        ax1.plot(n, [p["step_seconds"] * 1e3 for p in pts], "-o", ms=3, color=color, label=s["strategy"])
        ax2.plot(n, [100 * p["comm_share"] for p in pts], "-o", ms=3, color=color, label=s["strategy"])
        measured = [v for v in d.get("validation", []) if v.get("strategy") == s["strategy"]]
        if measured:
            ax1.plot([v["devices"] for v in measured], [v["step_seconds"] * 1e3 for v in measured], "x", color=color)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("step (ms), modelled; x: measured here")
    ax1.set_title("step time")
    ax2.set_ylabel("exposed communication (% of the step)")
    ax2.set_title("communication share")
    ax2.legend(frameon=False, fontsize=8)
    t = d["preset"]
    fig.suptitle(f"{d['model']}, {d['per_device']} images per device (weak scaling): a MODEL, preset {t['name']}\n"
                 f"{t['what']}")
    fig.tight_layout()
    save(fig, out, "scale.png")


def main():
    kinds = {"compare": compare, "comm": comm, "skew": skew, "bn": bn, "scale": scale}
    if len(sys.argv) != 4 or sys.argv[1] not in kinds:
        sys.exit("usage: plot.py compare|comm|skew|bn|scale DATA.json OUTDIR")
    kind, path, out = sys.argv[1:]
    with open(path) as f:
        d = json.load(f)
    os.makedirs(out, exist_ok=True)
    kinds[kind](d, out)


if __name__ == "__main__":
    main()
