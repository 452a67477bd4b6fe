#!/usr/bin/env python3
"""One command that checks the project on a GPU machine, in this order: the CUDA test lane, the rest of
the test suite in parallel workers, bench_step_time with the trainer, the GPU part of bench_memory,
and the cards pipeline on CUDA timed alone. Prints one summary table (device, torch, passed / failed
with the failures' names, every ratio beside its goal, the pipeline's seconds and mAP per stage) and
writes it as JSON.

    python3 benchmarks/gpu_check.py                      # everything; summary in gpu_check/summary.json
    python3 benchmarks/gpu_check.py --out DIR --workers 12 --parts cuda_lane,step_time --timeouts suite=300
    python3 benchmarks/gpu_check.py --dry-run            # the commands it would run, nothing else

Without a CUDA GPU it says so and runs what a CPU can: the CUDA lane (collected and skipped), the
step-time benchmark on the CPU in a short form (the trainer's host overhead shows there too) and,
with ``--suite``, the rest of the suite; the GPU-only parts are listed as not run.

On a GPU the CUDA lane and the suite run at the same time (the lane needs the GPU, the suite's workers
the cores; ``--no-overlap`` runs them in turn); the timed parts then run one by one, alone.
bench_step_time runs twice: at GNetDet-448 x1.0 batch 32 and at the cards config itself (224 x0.25
batch 16), where the host's work per iteration shows. The pipeline runs with 6 loader workers and 4
threads (the cards config's 0 workers and 2 threads are a 2-core CPU's).

Each part runs as its own process with a time limit (``--part-timeout``, or per part ``--timeouts``);
its whole output is kept in ``DIR/<part>.log``, and the summary is rewritten after every part. The suite's
workers are pytest-xdist's (``-n``, the slowest files named first: :data:`SLOW_FIRST`) where it is installed, else that
many pytest processes, each over a share of the test files (largest files first, to the least loaded
worker): xdist is not among the test requirements, and a CPU-only machine needs nothing more.

Goals (docs/training.md, benchmarks/bench_step_time.py, benchmarks/bench_memory.py): no failed test;
step3/step1 <= 1.15, bf16/fp32 >= 1.25, load/train >= 1.5, trainer/step >= 0.9; a variant with at
least 35% less peak memory at no more than 10% more step time, per model; the cards pipeline in at
most 120 s. Exit status: 0 every part that ran met its goal (``all_met`` in the JSON: and every part
ran, on a GPU); 1 a part failed or missed its goal; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PARTS = ("cuda_lane", "suite", "step_time", "memory", "pipeline")
#: the issue's GPU timing setting: full-width GNetDet-448 on the cards images
STEP_TIME_GPU = {
    "448": ["--config", "examples/cards.py", "--device", "cuda", "--trainer", "image_size", "448",
            "gnetdet.width_mult", "1.0", "gnetdet.mask_bits", "8,3,3,3,3,3,8", "batch_size", "32",
            "num_workers", "12", "threads", "8"],
    # the cards config itself (224 x0.25, batch 16): a step of a few milliseconds, where the host's work
    # per iteration shows; its 0 workers and 2 threads are a 2-core CPU's choice, not a GPU machine's
    "cards": ["--config", "examples/cards.py", "--device", "cuda", "--trainer", "num_workers", "6", "threads", "4"],
}
STEP_TIME_CPU = {"cards": ["--config", "examples/cards.py", "--device", "cpu", "--trainer", "--iters", "4",
                           "--rounds", "2", "num_workers", "0"]}
#: what the timed parts need first: the cards dataset's annotation files (README: run tools/xml_2_txt.py)
PREPARE = [PY, "tools/xml_2_txt.py", "--config", "examples/cards.py"]
#: the pipeline's settings on a GPU machine beside the cards config's (which are a 2-core CPU's)
PIPELINE_GPU = ["num_workers", "6", "threads", "4"]
RATIO_GOALS = {  # printed label in bench_step_time -> (name, comparison, goal)
    "ratio step3/step1": ("step3/step1", "<=", 1.15),
    "speed bf16/fp32": ("bf16/fp32", ">=", 1.25),
    "ratio load/train": ("load/train", ">=", 1.5),
    "ratio loop/step": ("loop/step", None, None),
    "ratio trainer/step": ("trainer/step", ">=", 0.9),
    "ratio torch.ao QAT": ("torch.ao QAT/float", None, None),   # the peer: met when step3/step1 is smaller
}
#: the suite's slowest files (processes started per test: gloo groups, the launcher, killed workers),
#: named first so that xdist hands them out first: on an H100 machine with 13 workers, a run cut at
#: 242 s had left exactly these (and PP-YOLO's training tests) for the end
SLOW_FIRST = ("tests/dist/test_dist_train.py", "tests/models/test_ppyolo_train.py", "tests/engine/test_faults.py",
              "tests/dist/test_dist_units.py", "tests/engine/test_reliability.py")
MEMORY_GOAL = (-35.0, 10.0)      # peak change (%) at most, step-time change (%) at most
PIPELINE_GOAL_S = 120.0


def pytest_summary(text: str) -> Dict[str, Any]:
    """Counts and failed test ids from pytest output (run with ``-rfE``, and ``-v`` so that a run cut
    short still names its tests: ``PASSED`` / ``FAILED`` per test, pytest-xdist's ``[gw0] [ 5%] FAILED
    id`` or pytest's ``id FAILED [ 5%]``).

    Returns:
        {"passed", "failed", "skipped", "errors", "deselected": int, "failures": [test ids]}, the counts
        from pytest's closing line, or from the per-test lines when the run ended before it.
    """
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0}
    lines = [l for l in text.splitlines() if re.match(r"^=+ .* in [\d.]+s", l) or re.match(r"^\d+ \w+.* in [\d.]+s", l)]
    for line in lines[-1:]:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", line):
            counts["errors" if word.startswith("error") else word] += int(n)
    failures: List[str] = []
    per_test = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}
    seen = {k: set() for k in per_test.values()}
    for l in text.splitlines():
        words = l.split()
        ids = [w for w in words if "::" in w]
        status = next((per_test[w] for w in words if w in per_test), None)
        if status is None or not ids:
            continue
        seen[status].add(ids[0])
        if status in ("failed", "errors") and ids[0] not in failures:
            failures.append(ids[0])
    if not lines:
        for k, ids in seen.items():
            counts[k] = len(ids)
    return {**counts, "failures": failures}


def merge_summaries(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The sum of several :func:`pytest_summary` results (the suite's shards)."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0, "failures": []}
    for p in parts:
        for k in out:
            out[k] = out[k] + p[k]
    return out


def step_time_ratios(text: str) -> Dict[str, Dict[str, Any]]:
    """bench_step_time's ratio lines -> {name: {"value", "goal", "cmp", "met"}} (``met`` None where
    the ratio has no goal)."""
    out = {}
    for line in text.splitlines():
        for label, (name, cmp, goal) in RATIO_GOALS.items():
            if line.startswith(label):
                value = float(line[len(label):].split()[0])
                met = None if goal is None else (value <= goal if cmp == "<=" else value >= goal)
                out[name] = {"value": value, "goal": goal, "cmp": cmp, "met": met}
    peer, ours = out.get("torch.ao QAT/float"), out.get("step3/step1")
    if peer and ours:
        peer.update(goal=ours["value"], cmp=">", met=ours["value"] < peer["value"])
    return out


def memory_rows(text: str) -> Dict[str, Dict[str, Any]]:
    """bench_memory's GPU tables -> {model title: {"rows": {variant: [peak MiB, peak %, step s, step %]},
    "met": bool, "best": variant or None}} (a variant meets the goal with peak change <= -35% and step
    change <= +10%)."""
    out: Dict[str, Dict[str, Any]] = {}
    title = None
    row = re.compile(r"^\s+(\w+)\s+peak\s+([\d.]+) MiB \(\s*([+-][\d.]+)%\)\s+step\s+([\d.]+) s \(\s*([+-][\d.]+)%\)")
    for line in text.splitlines():
        if line.startswith("GPU ") and line.rstrip().endswith(":"):
            title = line.rstrip(":")
            out[title] = {"rows": {}}
            continue
        m = row.match(line)
        if m and title:
            out[title]["rows"][m.group(1)] = [float(m.group(i)) for i in range(2, 6)]
    for entry in out.values():
        ok = [v for v, (_, dp, _, dt) in entry["rows"].items() if dp <= MEMORY_GOAL[0] and dt <= MEMORY_GOAL[1]]
        entry["met"] = bool(ok)
        entry["best"] = min(ok, key=lambda v: entry["rows"][v][1]) if ok else None
    return out


def pipeline_rows(text: str) -> Dict[str, Dict[str, Optional[float]]]:
    """run_pipeline's table -> {stage: {"entry", "best", "seconds"}} (None for "-")."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(step1|step2|cal|step3|step4|control)\s+(\S+)\s+(\S+)\s+.*?\s(\d+)\s*$", line)
        if m:
            val = lambda s: None if s == "-" else float(s)  # noqa: E731
            out[m.group(1)] = {"entry": val(m.group(2)), "best": val(m.group(3)), "seconds": float(m.group(4))}
    return out


def test_files() -> List[str]:
    """Every test file of the suite: tests/test_*.py and those of its folders (tests/<package>/,
    tests/scripts/), as absolute paths in sorted order."""
    return sorted(os.path.join(d, f) for d, _sub, names in os.walk(os.path.join(ROOT, "tests"))
                  for f in names if f.startswith("test_") and f.endswith(".py"))


def shards(files: List[str], workers: int) -> List[List[str]]:
    """Test files dealt to ``workers`` shards, largest first to the least loaded (size as the cost)."""
    bins: List[List[str]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(bins)
    for f in sorted(files, key=lambda f: (-os.path.getsize(f), f)):
        i = load.index(min(load))
        bins[i].append(f)
        load[i] += os.path.getsize(f)
    return [b for b in bins if b]


def parse_timeouts(text: str) -> Dict[str, float]:
    """``--timeouts``: "part=seconds,..." -> {part: seconds}.

    Raises:
        argparse.ArgumentTypeError: an unknown part, or seconds that are not a positive number.
    """
    out: Dict[str, float] = {}
    for item in [x for x in text.split(",") if x]:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in PARTS or seconds <= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: write PART=SECONDS with PART one of {','.join(PARTS)} "
                                             "and SECONDS positive")
        out[name] = seconds
    return out


def have_xdist() -> bool:
    try:
        import xdist  # noqa: F401
        return True
    except ImportError:
        return False


class Check:
    """The parts' commands, their runs and the summary (module docstring)."""

    def __init__(self, args, cuda: bool):
        self.args, self.cuda = args, cuda
        self.results: Dict[str, Dict[str, Any]] = {}

    def commands(self, part: str) -> List[List[str]]:
        a = self.args
        pytest = [PY, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider"]
        if part == "cuda_lane":
            return [pytest + ["-m", "cuda"]]
        if part == "suite":
            if have_xdist():    # the slow files first (pytest collects a path given twice once), then the rest
                slow = [f for f in SLOW_FIRST if os.path.isfile(os.path.join(ROOT, f))]
                return [pytest + ["-m", "not cuda", "-n", str(a.workers), "--durations", "15", *slow, "tests"]]
            return [pytest + ["-m", "not cuda", *s] for s in shards(test_files(), a.workers)]
        if part == "step_time":         # one after the other (timings alone), in STEP_TIME_* order
            return [[PY, "benchmarks/bench_step_time.py", *a] for a in self.step_time_runs().values()]
        if part == "memory":
            return [[PY, "benchmarks/bench_memory.py", "--gpu-only"]]
        if part == "pipeline":
            ck = os.path.join(os.path.abspath(a.out), "pipeline")
            return [PREPARE,                                                 # the meta files, as a user would
                    [PY, "tools/run_pipeline.py", "--config", "examples/cards.py", "device", "cuda", *PIPELINE_GPU,
                     "checkpoint_root", os.path.join(ck, "checkpoint"), "log_root", os.path.join(ck, "log"),
                     "model_root", os.path.join(ck, "model")]]
        raise ValueError(part)

    def prepare(self) -> bool:
        """Make the cards dataset's annotation files (:data:`PREPARE`), which bench_step_time reads as
        training does, before the timed parts; the pipeline part makes them again inside its timing, as
        a user would. Returns whether it succeeded; a failure is printed (step_time then fails on its
        own one-line message)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        r = subprocess.run(PREPARE, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"[gpu_check] {' '.join(PREPARE[1:])} failed (exit {r.returncode}):\n"
                  + (r.stdout + r.stderr)[-2000:], flush=True)
        return r.returncode == 0

    def step_time_runs(self) -> Dict[str, List[str]]:
        """bench_step_time's runs, {label: arguments}: two settings on a GPU, a short one on a CPU."""
        return STEP_TIME_GPU if self.cuda else STEP_TIME_CPU

    def timeout(self, part: str) -> float:
        """Seconds ``part`` may take: its ``--timeouts`` entry, else ``--part-timeout``."""
        return self.args.timeouts.get(part, self.args.part_timeout)

    def skipped_without_gpu(self, part: str) -> bool:
        return not self.cuda and (part in ("memory", "pipeline") or (part == "suite" and not self.args.suite))

    def run(self, part: str) -> Dict[str, Any]:
        cmds = self.commands(part)
        # the tools import gnetmdk as installed (pip install -e .): this checkout's package first on the
        # path of every part, so that a bare GPU machine, or one with another checkout installed, runs it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        if part == "suite":                              # the workers share the cores: one thread each
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(self.args.workers, 1))))
        t0, limit = time.perf_counter(), self.timeout(part)
        start = lambda c: subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE,  # noqa: E731
                                           stderr=subprocess.STDOUT, text=True)
        sequential = part in ("step_time", "pipeline")   # timings, or a command that needs the one before
        procs = [] if sequential else [start(c) for c in cmds]
        texts, timed_out = [], False
        for i in range(len(cmds)):
            if sequential:
                if timed_out:
                    texts.append("")
                    continue
                procs.append(start(cmds[i]))
            p = procs[i]
            left = max(1.0, limit - (time.perf_counter() - t0))
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                timed_out = True
                p.kill()
                out, _ = p.communicate()
            texts.append(out or "")
        seconds = time.perf_counter() - t0
        text = "\n".join(texts)
        with open(os.path.join(self.args.out, f"{part}.log"), "w") as fh:
            fh.write(text)
        res: Dict[str, Any] = {"seconds": round(seconds, 1), "exit": [p.returncode for p in procs] + [None] * (
                               len(cmds) - len(procs)),
                               "timed_out": timed_out, "commands": [" ".join(c) for c in cmds]}
        if part in ("cuda_lane", "suite"):
            res.update(merge_summaries([pytest_summary(t) for t in texts]))
            res["met"] = not timed_out and res["failed"] == 0 and res["errors"] == 0 and res["passed"] + res["skipped"] > 0
        elif part == "step_time":
            res["ratios"] = {}
            for label, t in zip(self.step_time_runs(), texts):
                res["ratios"].update({f"{label}: {k}": v for k, v in step_time_ratios(t).items()})
            if not res["ratios"] or timed_out or any(p.returncode != 0 for p in procs):
                res["met"] = False
            elif self.cuda:
                res["met"] = all(r["met"] is not False for r in res["ratios"].values())
            else:                                        # the goals are a GPU's: on a CPU the ratios inform
                res["met"] = None
        elif part == "memory":
            res["models"] = memory_rows(text)
            res["met"] = bool(res["models"]) and all(m["met"] for m in res["models"].values())
        else:
            res["stages"] = pipeline_rows(text)
            res["met"] = (not timed_out and all(p.returncode == 0 for p in procs) and "step4" in res["stages"]
                          and seconds <= PIPELINE_GOAL_S)
        return res

    def table(self) -> str:
        lines = [f"{'part':<13} {'result':<58} {'goal':<14} {'seconds':>7}"]
        for part in PARTS:
            r = self.results.get(part)
            if r is None:
                continue
            if "not_run" in r:
                lines.append(f"{part:<13} {'not run: ' + r['not_run']:<58} {'':<14} {'':>7}")
                continue
            secs = f"{r['seconds']:7.0f}"
            if part in ("cuda_lane", "suite"):
                res = f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped"
                if r["timed_out"]:
                    res += " (TIMED OUT)"
                lines.append(f"{part:<13} {res:<58} {'0 failed':<14} {secs}")
                lines += [f"{'':<13}   FAILED {f}" for f in r["failures"]]
            elif part == "step_time":
                lines.append(f"{part:<13} {'(bench_step_time' + (' on the CPU, short' if not self.cuda else '') + ')':<58}"
                             f" {'':<14} {secs}")
                for name, q in r["ratios"].items():
                    goal = "" if q["goal"] is None else f"{q['cmp']} {q['goal']:g}"
                    mark = "" if q["met"] is None or not self.cuda else ("met" if q["met"] else "MISSED")
                    lines.append(f"{'':<13}   {name:<28} {q['value']:<25.3f} {goal:<8} {mark:<5}")
            elif part == "memory":
                lines.append(f"{part:<13} {'(bench_memory, GPU)':<58} {'-35% at +10%':<14} {secs}")
                for title, m in r["models"].items():
                    best = m["best"] or "none"
                    lines.append(f"{'':<13}   {title[:44]:<44} best {best:<8} {'met' if m['met'] else 'MISSED'}")
                    for v, (pk, dp, st, dt) in m["rows"].items():
                        lines.append(f"{'':<13}     {v:<10} peak {pk:9.1f} MiB {dp:+6.1f}%  step {st:.3f} s {dt:+6.1f}%")
            else:
                stages = ", ".join(f"{k} {v['best']:.4f}" for k, v in r["stages"].items() if v["best"] is not None)
                lines.append(f"{part:<13} {stages[:58]:<58} {'<= 120 s':<14} {secs}")
        return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="gpu_check", help="folder for the logs and summary.json (default gpu_check)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel workers of the suite (default: the cores less 4, which the CUDA lane run beside "
                        "it uses; 2 without a GPU)")
    p.add_argument("--part-timeout", type=float, default=480.0, help="seconds each part may take (default 480)")
    p.add_argument("--timeouts", default="", type=parse_timeouts, metavar="PART=S,...",
                   help="per-part limits in seconds, beside --part-timeout (e.g. suite=240,pipeline=200)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="on a GPU, run the CUDA lane and the suite one after the other (default: at once; "
                        "both are pass / fail, and the lane needs the GPU, the suite the CPU cores)")
    p.add_argument("--suite", action="store_true", help="without a GPU, also run the suite (slow on small CPUs)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        p.error(f"--parts: unknown part(s) {bad or parts}; choose from {','.join(PARTS)}")
    if args.workers is None:
        import torch
        args.workers = max(1, (os.cpu_count() or 2) - 4) if torch.cuda.is_available() else 2
    if args.workers < 1 or args.part_timeout <= 0:
        p.error("--workers must be at least 1 and --part-timeout positive")
    import torch
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"no CUDA GPU (torch {torch.__version__} sees none)"
    check = Check(args, cuda)
    print(f"device: {device}; torch {torch.__version__}; {os.cpu_count()} CPU cores")
    if not cuda:
        print("no GPU: running what a CPU can (the CUDA lane is collected and skipped, the step-time benchmark "
              "runs short on the CPU" + (", the suite runs" if args.suite else "") + "); the GPU parts are listed "
              "as not run")
    if args.dry_run:
        for part in parts:
            if check.skipped_without_gpu(part):
                print(f"{part}: not run without a GPU")
                continue
            for c in check.commands(part):
                print(f"{part}: " + " ".join(c))
        return 0
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    path = os.path.join(args.out, "summary.json")

    def write_summary(all_met: bool) -> None:            # after every part: a run cut short keeps its results
        summary = {"device": device, "torch": torch.__version__, "cuda": cuda, "cpu_cores": os.cpu_count(),
                   "seconds": round(time.perf_counter() - t0, 1), "parts": check.results, "all_met": all_met}
        with open(path + ".tmp", "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(path + ".tmp", path)

    todo = [x for x in PARTS if x in parts]
    if "step_time" in todo and not check.skipped_without_gpu("step_time"):
        check.prepare()
    for part in todo:
        if part in check.results:
            continue
        if check.skipped_without_gpu(part):
            check.results[part] = {"not_run": "no GPU" if part != "suite" else "no GPU (--suite runs it)"}
            continue
        together = [part]
        if cuda and args.overlap and part == "cuda_lane" and "suite" in todo:
            together.append("suite")
        print(f"[gpu_check] {' + '.join(together)} ...", flush=True)
        if len(together) == 1:
            check.results[part] = check.run(part)
        else:
            with ThreadPoolExecutor(len(together)) as pool:
                for name, res in zip(together, pool.map(check.run, together)):
                    check.results[name] = res
        write_summary(False)
    total = time.perf_counter() - t0
    table = check.table()
    print(table)
    print(f"total {total:.0f} s")
    ran = [r for r in check.results.values() if "not_run" not in r]
    ok = bool(ran) and all(r["met"] is not False for r in ran)
    all_met = ok and cuda and len(ran) == len(PARTS)
    write_summary(all_met)
    print(f"summary: {path}; " + ("every part ran and met its goal" if all_met else
                                  "what ran passed; the GPU parts are unchecked" if ok else "a part failed or missed its goal"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
