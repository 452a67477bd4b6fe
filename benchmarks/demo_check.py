#!/usr/bin/env python3
"""Does README command (a), the shapes demo, give the same numbers on any machine? One command, pass/fail.

    python3 benchmarks/demo_check.py                                  # seeds 0-2 x threads 1, 2 x default, avx2
    python3 benchmarks/demo_check.py --seeds 0 --threads 2 --kernels default --jobs 1 --out runs/demo
    python3 benchmarks/demo_check.py --seeds 0,1,2 --threads 1 --jobs 2 gnetdet.box_slots 1 num_epochs 48

Each variant runs `tools/run_pipeline.py --config examples/shapes.py --make-shapes --control` (the demo,
then its float control: gnetmdk/engine/control.py) in its own folder under --out, data included, with
`seed K threads T`, the config overrides given after the options (``key value`` pairs, as run_pipeline
takes them: a candidate recipe checked by the same command) and the kernel set's environment:

- ``default``: the kernels torch picks on this CPU;
- ``avx2``: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (on an AVX-512 CPU, other kernels);
- ``generic``: ``ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default`` (other kernels and summation orders
  on any x86 CPU, AVX2 ones included: a stand-in for another machine; 4 to 8 times slower than the
  default kernels on an AVX-512 CPU, so not in the default set).

Each variant's folder records the config it ran (config.json); a rerun with the same --out goes on where
it stopped and refuses (exit 2) a folder of another config. Runs of one variant each are independent;
``--jobs N`` runs N at once (give each ``threads`` cores, or read the demo's seconds as upper bounds). The table gives per variant the demo's seconds (its stages,
without the control), step 1's best val mAP and how far it moved over its last quarter of epochs
(``plateau``), step 4, the control and the quantization cost step 4 - max(step 1, control).

The goals (docs/results/shapes-demo.md), all of which must hold for exit status 0:

- every step 1 within a range of at most 3 points (:data:`STEP1_RANGE`) across the variants;
- every step 1 at its plateau: val mAP moved less than 1 point over its last quarter
  (gnetmdk.engine.control.PLATEAU_SPAN);
- every step 4 at most 1.5 points (:data:`COST_LIMIT`) below max(step 1, control);
- with ``--jobs 1``, every demo run as command (a) runs it (the config's own ``threads``, the default
  kernels) within 8 minutes (:data:`DEMO_SECONDS`); a variant at fewer threads leaves cores idle and
  one on other kernels stands in for another machine, so their seconds are printed, not judged.

``--reference FILE`` (the ``--json`` of a run on another machine; repeatable) also compares weights, bit for bit:
every variant's step 1, step 4 and control best.pth (their ``weights_sha256`` in run_pipeline's JSON)
against the reference's run with the same seed and thread count, the same torch version, the same
CPU capability (``torch.backends.cpu.get_cpu_capability()`` under the kernel set's environment, e.g.
AVX2) and the same OpenCV version (it makes the augmented pixels): where those agree, the two machines should have computed the same bits, and a differing digest
is a missed goal; runs of another config are never compared (an override that repeats the demo's own
value, as ``shapes_upright true`` does, is no other config). Variants without such a
reference run are listed as not compared.

Exit status: 0 every goal met, 1 a goal missed, 2 a run failed (its log named) or bad arguments.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: kernel set -> environment of its runs
KERNELS = {"default": {},
           "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
           "generic": {"ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"}}
#: step 1's best val mAP across the variants: max - min at most this (a fraction)
STEP1_RANGE = 0.03
#: step 4 - max(step 1, control) at least minus this (a fraction)
COST_LIMIT = 0.015
#: the demo's stages (without the control) within this many seconds, when the runs had the machine alone
DEMO_SECONDS = 480.0
#: the demo's config, run by every variant
DEMO_CONFIG = os.path.join(ROOT, "examples", "shapes.py")
#: the stages whose best.pth weights --reference compares
DIGEST_STAGES = ("step1", "step4", "control")


def variant_name(seed: int, threads: int, kernels: str) -> str:
    """The folder (under --out) and table name of one variant, e.g. ``seed0-t2-default``."""
    return f"seed{seed}-t{threads}-{kernels}"


def command(out: str, seed: int, threads: int, overrides: Sequence[str] = ()) -> List[str]:
    """run_pipeline's command of one variant: the demo and its control, every output under ``out``, with
    the config ``overrides`` (``key value`` pairs) after the variant's own."""
    return [sys.executable, os.path.join(ROOT, "tools", "run_pipeline.py"), "--config",
            DEMO_CONFIG, "--make-shapes", "--control",
            "--json", os.path.join(out, "stages.json"), "seed", str(seed), "threads", str(threads),
            "progress", "false", "data_root", os.path.join(out, "data"), "meta_root", os.path.join(out, "meta"),
            "checkpoint_root", os.path.join(out, "checkpoint"), "log_root", os.path.join(out, "log"),
            "model_root", os.path.join(out, "model"), *overrides]


#: config fields that name a variant's own folders: left out of its recorded config, so a moved --out resumes
FOLDER_FIELDS = ("data_root", "meta_root", "checkpoint_root", "log_root", "model_root", "dataset_path", "image_dir")


def resolved_config(seed: int, threads: int, overrides: Sequence[str] = ()) -> Dict[str, object]:
    """The demo's config as a variant's run resolves it (examples/shapes.py, then the variant's seed and
    threads and the ``overrides``), as plain JSON data without :data:`FOLDER_FIELDS`: what decides whether
    a folder's run is this check's run, whatever words asked for it.

    Raises:
        gnetmdk.config.ConfigError: an override that is no field, or a value that does not convert.
    """
    from gnetmdk.config.overrides import build_config, load_config_class

    cfg = build_config(load_config_class(DEMO_CONFIG), ["seed", str(seed), "threads", str(threads), *overrides])
    values = {k: v for k, v in cfg.to_dict().items() if k not in FOLDER_FIELDS}
    return json.loads(json.dumps(values, sort_keys=True, default=repr))


def stale_variants(out: str, variants: Sequence[tuple], overrides: Sequence[str]) -> List[str]:
    """The folders under ``out`` of ``variants`` ((seed, threads, kernels) tuples) that hold a run of
    another config than this check's (:func:`resolved_config` against the folder's config.json). A folder
    with files but no readable config.json (made by an older demo_check, whose demo may have differed)
    counts as another config; an empty one does not. Such a folder must not be resumed or read as this
    check's run.

    Raises:
        gnetmdk.config.ConfigError: bad ``overrides`` (resolved_config).
    """
    stale = []
    for v in variants:
        d = os.path.join(out, variant_name(*v))
        if not os.path.isdir(d) or not os.listdir(d):
            continue
        want = resolved_config(v[0], v[1], overrides)
        try:
            with open(os.path.join(d, "config.json"), encoding="utf-8") as fh:
                theirs = json.load(fh)
        except (OSError, ValueError):
            theirs = None                      # missing or unreadable: not known to match, so not resumed
        if theirs != want:
            stale.append(d)
    return stale


def run_variant(out: str, seed: int, threads: int, kernels: str, overrides: Sequence[str] = ()) -> Optional[str]:
    """Runs one variant unless its stages.json exists (a rerun goes on where it stopped), recording the
    config overrides in the folder's overrides.json and the resolved config in its config.json first.
    Returns None, or the path of the log of a run that failed."""
    d = os.path.join(out, variant_name(seed, threads, kernels))
    if os.path.isfile(os.path.join(d, "stages.json")):
        return None
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "overrides.json"), "w", encoding="utf-8") as fh:
        json.dump(list(overrides), fh)
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(resolved_config(seed, threads, overrides), fh, indent=1, sort_keys=True)
    log = os.path.join(d, "run.log")
    env = dict(os.environ, **KERNELS[kernels])
    with open(log, "w", encoding="utf-8") as fh:
        rc = subprocess.run(command(d, seed, threads, overrides), cwd=ROOT, env=env, stdout=fh,
                            stderr=subprocess.STDOUT).returncode
    return None if rc == 0 else log


def kernel_identity(kernels: str) -> Dict[str, str]:
    """What decides a run's bits besides its seed and threads: torch's version, the CPU capability ATen
    dispatches to (``AVX2``, ``AVX512``, ...) and OpenCV's version (its resize and warpAffine make the
    augmented pixels, and their rounding differs between releases: 4.14 and 5.1 differ by up to 4 codes
    on 12-23% of the pixels of the cards photos), read in a child process with the kernel set's
    environment, as the runs see them (gnetmdk.utils.environment.run_environment, the record every checkpoint
    holds). Raises subprocess.CalledProcessError when torch or cv2 cannot be imported."""
    code = ("import json; from gnetmdk.utils.environment import run_environment; e = run_environment(); "
            "print(json.dumps({k: e[k] for k in ('torch', 'cpu_capability', 'opencv')}))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **KERNELS[kernels]),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(records: Sequence[dict]) -> Dict[str, object]:
    """One variant's numbers from run_pipeline's JSON rows (mAP as fractions, seconds): ``seconds`` (the
    demo's stages, not the control), ``step1``, ``plateau`` (step 1's plateau_span), ``step4``,
    ``control``, ``cost`` (step 4 - max(step 1, control)), and ``digests``: stage -> weights_sha256 of
    its best.pth for :data:`DIGEST_STAGES` (None where a row has none)."""
    rows = {r["stage"]: r for r in records}
    step1, step4 = rows["step1"]["best_map"], rows["step4"]["best_map"]
    control = rows["control"]["best_map"] if "control" in rows else None
    return {"seconds": sum(r.get("seconds") or 0.0 for s, r in rows.items() if s != "control"),
            "step1": step1, "plateau": rows["step1"].get("plateau_span"), "step4": step4, "control": control,
            "cost": step4 - max(step1, control if control is not None else step1),
            "digests": {k: rows[k].get("weights_sha256") for k in DIGEST_STAGES if k in rows}}


def effective_overrides(overrides: Sequence[str]) -> Dict[str, str]:
    """The config ``overrides`` (``key value`` words) that change the demo: {field: value} for those whose
    resolved value differs from examples/shapes.py's in step 1 or in a later stage (the demo sets some
    fields per stage: ``eval_interval 2`` changes steps 2-4 only), the key as written and the value as the
    ``repr`` of its step-1 value (of its values in steps 1-4 where step 1 keeps the demo's). So
    ``shapes_upright true`` is no override once the demo draws upright triangles, and a reference run made
    with it compares with a run made without. Words the config does not take (a file from another version)
    are kept as written."""
    from gnetmdk.config.overrides import ConfigError, build_config, config_value, load_config_class, split_overrides

    try:
        pairs = split_overrides(list(overrides or []))
        if not pairs:
            return {}
        klass = load_config_class(DEMO_CONFIG)
        steps = (1, 2, 3, 4)
        base = [build_config(klass, step=k) for k in steps]
        cfg = [build_config(klass, list(overrides), step=k) for k in steps]
        out = {}
        for key, _ in pairs:
            mine, theirs = [config_value(c, key) for c in cfg], [config_value(c, key) for c in base]
            if mine[0] != theirs[0]:
                out[key] = repr(mine[0])
            elif mine != theirs:
                out[key] = repr(mine)
        return out
    except ConfigError:          # an unknown field or value: compare the words themselves
        return {str(i): w for i, w in enumerate(overrides)}


def compare_reference(results: Dict[str, dict], reference: Dict[str, dict]):
    """Weights of each variant against the reference's run with the same seed, threads, torch, CPU
    capability, OpenCV and config (module docstring). ``results`` and ``reference`` map variant names to
    summarize()'s dicts with ``seed``, ``threads``, ``torch``, ``cpu_capability``, ``opencv`` and
    ``overrides`` (a list; missing in files written before it existed, read as none) added; overrides agree
    when they change the demo's config the same way (:func:`effective_overrides`). A reference without
    ``opencv`` (written before it was recorded) is compared with no run that records one: its OpenCV is
    unknown. Returns (notes, missed): one note per variant (equal, or not compared and why) and one missed
    line per variant whose digests differ."""
    keys = ("seed", "threads", "torch", "cpu_capability", "opencv")

    def same(x, r):
        return (all(x.get(k) == r.get(k) for k in keys)
                and effective_overrides(x.get("overrides")) == effective_overrides(r.get("overrides")))

    notes, missed = [], []
    for name, r in results.items():
        match = [(n, x) for n, x in reference.items() if same(x, r)]
        if not match:
            extra = f" and overrides {' '.join(r['overrides'])}" if r.get("overrides") else ""
            notes.append(f"{name}: not compared (no reference run with seed {r.get('seed')}, threads "
                         f"{r.get('threads')}, torch {r.get('torch')}, CPU capability {r.get('cpu_capability')} "
                         f"and OpenCV {r.get('opencv')}{extra})")
            continue
        ref_name, ref = match[0]
        mine, theirs = r.get("digests") or {}, ref.get("digests") or {}
        both = [k for k in DIGEST_STAGES if mine.get(k) and theirs.get(k)]
        if not both:
            notes.append(f"{name}: not compared (no weights digests in this run or in the reference's {ref_name})")
            continue
        differ = [k for k in both if mine[k] != theirs[k]]
        if differ:
            missed.append(f"{name}: the weights of {', '.join(differ)} differ from the reference's {ref_name} "
                          f"(same seed, threads, torch {r['torch']}, CPU capability {r['cpu_capability']} "
                          f"and OpenCV {r.get('opencv')})")
        else:
            notes.append(f"{name}: {', '.join(both)} equal bit for bit to the reference's {ref_name}")
    return notes, missed


def demo_threads() -> int:
    """The thread count command (a) runs with: examples/shapes.py's ``threads``."""
    from gnetmdk.config.overrides import build_config, load_config_class
    return int(build_config(load_config_class(DEMO_CONFIG)).threads)


def verdicts(results: Dict[str, dict], timed: bool) -> List[str]:
    """The goals missed, one line each (empty: every goal met). With ``timed`` the seconds of the variants
    that run as command (a) does (``threads`` of :func:`demo_threads`, ``kernels`` default; a result without
    those keys counts as such) are held to :data:`DEMO_SECONDS`."""
    missed = []
    own_threads = demo_threads() if timed else None
    s1 = [r["step1"] for r in results.values()]
    if max(s1) - min(s1) > STEP1_RANGE:
        missed.append(f"step 1 ranges over {100 * (max(s1) - min(s1)):.1f} points (goal at most {100 * STEP1_RANGE:.0f})")
    for name, r in results.items():
        if r["plateau"] is None or r["plateau"] >= 0.01:
            moved = "unknown" if r["plateau"] is None else f"{100 * r['plateau']:.1f} points"
            missed.append(f"{name}: step 1 moved {moved} over its last quarter (goal under 1)")
        if r["cost"] < -COST_LIMIT:
            missed.append(f"{name}: step 4 is {-100 * r['cost']:.1f} points below max(step 1, control) "
                          f"(goal at most {100 * COST_LIMIT:.1f})")
        as_command_a = r.get("threads", own_threads) == own_threads and r.get("kernels", "default") == "default"
        if timed and as_command_a and r["seconds"] > DEMO_SECONDS:
            missed.append(f"{name}: the demo took {r['seconds']:.0f} s (goal at most {DEMO_SECONDS:.0f})")
    return missed


def format_table(results: Dict[str, dict]) -> str:
    """The markdown table of the variants (mAP as fractions, plateau and cost in points) and a line with
    the ranges of step 1 and step 4 over them."""
    lines = ["| variant | demo seconds | step 1 | plateau (points) | step 4 | control | step 4 - max(step 1, control) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        plateau = "-" if r["plateau"] is None else f"{100 * r['plateau']:.1f}"
        control = "-" if r["control"] is None else f"{r['control']:.4f}"
        lines.append(f"| {name} | {r['seconds']:.0f} | {r['step1']:.4f} | {plateau} | {r['step4']:.4f} | {control} "
                     f"| {100 * r['cost']:+.1f} |")
    s1 = [r["step1"] for r in results.values()]
    s4 = [r["step4"] for r in results.values()]
    lines.append(f"\nstep 1 {min(s1):.3f}-{max(s1):.3f}, step 4 {min(s4):.3f}-{max(s4):.3f} over {len(results)} run(s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--kernels", default="default,avx2",
                   help=f"comma-separated kernel sets of {','.join(KERNELS)} (default default,avx2)")
    p.add_argument("--jobs", type=int, default=1, help="variants run at once (default 1: the demo timed alone)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo_check"), help="outputs (default runs/demo_check)")
    p.add_argument("--json", default=None, help="also write the table and the verdicts as JSON here")
    p.add_argument("--reference", action="append", default=[],
                   help="a --json of another machine's run (repeatable): compare the weights bit for bit where "
                        "seed, threads, torch, CPU capability and OpenCV agree")
    p.add_argument("overrides", nargs="*", metavar="KEY VALUE",
                   help="config overrides for every variant, as run_pipeline takes them (e.g. gnetdet.box_slots 1)")
    args = p.parse_intermixed_args(argv)      # options may follow the overrides
    if len(args.overrides) % 2:
        print(f"error: config overrides come in key value pairs; {args.overrides[-1]!r} has no value", file=sys.stderr)
        return 2
    reference = None
    for path in args.reference:        # read before any training, so a bad file costs nothing
        try:
            with open(path, encoding="utf-8") as fh:
                table = json.load(fh)["results"]
            if not isinstance(table, dict) or not all(isinstance(x, dict) for x in table.values()):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc if isinstance(exc, OSError) else "not a demo_check --json file (no \"results\" table)"
            print(f"error: --reference {path!r}: {why}", file=sys.stderr)
            return 2
        reference = reference or {}
        for name, x in table.items():
            reference[name if name not in reference else f"{name} ({os.path.basename(path)})"] = x
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        print(f"error: --seeds and --threads take comma-separated integers, not {args.seeds!r} / {args.threads!r}",
              file=sys.stderr)
        return 2
    kernels = args.kernels.split(",")
    bad = [k for k in kernels if k not in KERNELS]
    if bad or args.jobs < 1 or min(threads) < 1:
        print(f"error: --kernels takes {', '.join(KERNELS)} (not {', '.join(bad)}); --jobs and --threads at least 1",
              file=sys.stderr)
        return 2
    variants = list(itertools.product(seeds, threads, kernels))
    from gnetmdk.config import ConfigError
    try:
        resolved_config(seeds[0], threads[0], args.overrides)      # bad overrides: refused before any run
        stale = stale_variants(args.out, variants, args.overrides)
    except ConfigError as exc:
        print(f"error: config overrides {' '.join(args.overrides)}: {exc}", file=sys.stderr)
        return 2
    if stale:
        print(f"error: {', '.join(stale)} hold(s) runs made with another config (other overrides, or an older "
              "demo_check's demo); give another --out", file=sys.stderr)
        return 2
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        failed = [log for log in pool.map(lambda v: run_variant(args.out, *v, args.overrides), variants) if log]
    if failed:
        print("error: run(s) failed, see " + ", ".join(failed), file=sys.stderr)
        return 2
    results = {}
    identity = {k: kernel_identity(k) for k in kernels}
    for v in variants:
        name = variant_name(*v)
        with open(os.path.join(args.out, name, "stages.json"), encoding="utf-8") as fh:
            results[name] = summarize(json.load(fh))
        results[name].update(seed=v[0], threads=v[1], kernels=v[2], overrides=list(args.overrides), **identity[v[2]])
    missed = verdicts(results, timed=args.jobs == 1)
    print(format_table(results))
    print(f"{len(variants)} variant(s) in {time.time() - t0:.0f} s (jobs {args.jobs})"
          + (f", config overrides {' '.join(args.overrides)}" if args.overrides else ""))
    if reference is not None:
        notes, unequal = compare_reference(results, reference)
        for line in notes:
            print(f"reference: {line}")
        missed += unequal
    for line in missed:
        print(f"missed: {line}")
    print("demo check: " + ("PASS" if not missed else "FAIL"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"results": results, "missed": missed}, fh, indent=2)
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
