#!/usr/bin/env python3
"""Runs the same dp_train / dp_bench cases with two builds and compares what they write: stdout, the
checkpoints (byte for byte), the --report, the --log and the --trace and dp_bench's --json records, with
what measures time left out (seconds, images/s, timestamps, phase times, alpha-beta fits). For a change
that must not change what dp computes or writes (a refactor): every case must say "same".

Usage: scripts/same_outputs.py OLD_BUILD NEW_BUILD [--only NAME,...] [--keep DIR]
       e.g. scripts/same_outputs.py /tmp/main-build build
Each build directory holds dp_train and dp_bench. Needs Fashion-MNIST (scripts/deps.sh) and, for the
mpirun case, OpenMPI; a case whose command fails in both builds the same way still compares.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

DATA = "/usr/share/datasets/fashion-mnist"
SMALL = f"--data {DATA} --limit-train 1536 --limit-test 400 --backend cpu"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
OUTS = "--save ck.st --report report.json --trace trace.json --log log.jsonl --log-every 3"

# name: list of commands, run in order in one directory ({T} is dp_train, {B} dp_bench).
CASES = {
    "scatter-2": [f"{{T}} {SMALL} --devices 2 --steps 12 {OUTS}"],
    "allreduce-2": [f"{{T}} {SMALL} --devices 2 --sync allreduce --steps 12 {OUTS}"],
    "allreduce-3-uneven-buckets": [
        f"{{T}} {SMALL} --devices 3 --sync allreduce --batch 100 --bucket-kb 64 --steps 10 {OUTS}"],
    "naive-3": [f"{{T}} {SMALL} --devices 3 --sync allreduce --allreduce naive --batch 90 --steps 8 {OUTS}"],
    "scatter-4-chunk-idle": [f"{{T}} {SMALL} --devices 4 --split chunk --batch 9 --steps 6 --weight-decay 5e-4 {OUTS}"],
    "lenet-bn-scatter": [f"{{T}} {SMALL} --model lenet-bn --devices 2 --batch 64 --steps 8 {OUTS}"],
    "lenet-bn-syncbn-allreduce": [
        f"{{T}} {SMALL} --model lenet-bn --devices 3 --sync allreduce --sync-bn --bucket-kb 16 --batch 64 "
        f"--steps 8 {OUTS}"],
    "lenet5-no-prefetch": [
        f"{{T}} {SMALL} --model lenet5 --devices 2 --sync allreduce --no-prefetch --workers 0 --epochs 1 "
        f"--batch 512 {OUTS}"],
    "resume": [f"{{T}} {SMALL} --devices 2 --sync allreduce --steps 6 --save mid.st --quiet",
               f"{{T}} {SMALL} --devices 2 --sync allreduce --steps 12 --resume mid.st {OUTS}"],
    "eval": [f"{{T}} {SMALL} --devices 2 --steps 4 --save w.st --quiet",
             f"{{T}} {SMALL} --devices 3 --eval --load w.st --report report.json"],
    "verify": [f"{{T}} {SMALL} --devices 3 --sync allreduce --batch 50 --steps 5 --verify --report report.json"],
    "verify-scatter-lr": [f"{{T}} {SMALL} --devices 2 --batch 40 --steps 5 --lr 0.05 --momentum 0 --verify "
                          f"--report report.json"],
    "mpirun-2x2": [f"mpirun -np 2 {{T}} {SMALL} --devices 2 --sync allreduce --bucket-kb 32 --steps 8 {OUTS}"],
    "bench-compare": [f"{{B}} compare --backend cpu --gpus 0,1,2 --batch 96 --steps 3 --warmup 1 --repeats 1 "
                      f"--json compare.json"],
    "bench-skew": [f"{{B}} skew --backend cpu --devices 3 --batch 96 --json skew.json"],
    "bench-skew-cap": [f"{{B}} skew --backend cpu --devices 2 --batch 64 --device-memory 3M --json skew.json"],
    "errors": [f"{{T}} {SMALL} --sync zero9",
               f"{{T}} {SMALL} --bucket-kb 64 --steps 1",
               f"{{T}} {SMALL} --allreduce naive --steps 1",
               f"mpirun -np 2 {{T}} {SMALL} --devices 1 --steps 2"],
}

# Keys whose values are times or rates (or hold them), in any JSON record.
TIMING_KEYS = {"seconds", "images_per_second", "load_wait_seconds", "eval_seconds", "elapsed_s", "phase_ms",
               "started_at", "command_line", "command", "ts", "dur", "step_ms", "steps_ms", "phases",
               "comm_model_ms", "comm_measured_ms", "alpha_beta", "scaling", "memory"}


def strip(j):
    if isinstance(j, dict):
        return {k: strip(v) for k, v in j.items() if k not in TIMING_KEYS and not k.endswith("_ms")}
    if isinstance(j, list):
        return [strip(v) for v in j]
    return j


def normalize_stdout(text, build):
    text = text.replace(build, "BUILD")
    text = re.sub(r"[\d,.]+k? img/s", "N img/s", text)
    text = re.sub(r"of the [\d.]+ [KMGT]iB available", "of the N available", text)  # the machine's free memory
    text = re.sub(r"\d+\.\d+ s\b", "N s", text)
    text = re.sub(r"(step time.*|images/s.*|  [a-z+| -]+  .*\d+\.\d+ / .*|communication.*ms.*|.*α.*|.*measured: communication.*)",
                  "(timing)", text)
    return text


def read_outputs(d, build):
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if name.endswith(".json") or name.endswith(".jsonl"):
            with open(p) as f:
                lines = f.read().splitlines() if name.endswith(".jsonl") else [f.read()]
            recs = [strip(json.loads(line)) for line in lines if line.strip()]
            if name.startswith("trace"):  # the event order follows the timestamps: compare as a set
                recs = sorted(json.dumps(e, sort_keys=True) for r in recs for e in r["traceEvents"])
            out[name] = recs
        elif name.endswith(".st"):
            with open(p, "rb") as f:
                out[name] = f.read()
        elif name.startswith("cmd"):
            with open(p) as f:
                out[name] = normalize_stdout(f.read(), build)
    return out


def run_case(build, cmds, d):
    env = dict(os.environ, **MPI_ENV)
    for i, cmd in enumerate(cmds):
        c = cmd.replace("{T}", os.path.join(build, "dp_train")).replace("{B}", os.path.join(build, "dp_bench"))
        r = subprocess.run(c, shell=True, cwd=d, env=env, capture_output=True, text=True, timeout=900)
        # dp's own lines, sorted: under mpirun the ranks' lines interleave, and OpenMPI adds its own.
        # Which ranks print before MPI_Abort ends the job varies: each distinct line once, rank aside.
        lines = {re.sub(r"^rank \d+ \([^)]*\): ", "", l) for l in r.stderr.splitlines()
                 if "dp_train" in l or "dp_bench" in l}
        err = "\n".join(sorted(lines))
        with open(os.path.join(d, f"cmd{i}.txt"), "w") as f:
            f.write(f"exit {r.returncode}\n{r.stdout}\n--- stderr\n{err}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--only", default="")
    ap.add_argument("--keep", default="")
    a = ap.parse_args()
    names = [n for n in CASES if not a.only or n in a.only.split(",")]
    root = a.keep or tempfile.mkdtemp(prefix="same_outputs.")
    differ = 0
    for name in names:
        got = []
        for tag, build in (("old", a.old), ("new", a.new)):
            d = os.path.join(root, name, tag)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            run_case(os.path.abspath(build), CASES[name], d)
            got.append(read_outputs(d, os.path.abspath(build)))
        old, new = got
        bad = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        print(f"{name:28s} {'same' if not bad else 'DIFFERENT: ' + ', '.join(bad)}  "
              f"({', '.join(sorted(old))})", flush=True)
        differ += bool(bad)
    if not a.keep:
        shutil.rmtree(root)
    else:
        print(f"outputs in {root}/<case>/{{old,new}}")
    print(f"{len(names) - differ} of {len(names)} cases the same")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
