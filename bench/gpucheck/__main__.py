"""The acceptance run on a lent GPU: every part of kvscope measured on the card, one section at a time.

    python -m bench.gpucheck [--only NAME[,NAME]] [--dry-run] [--out DIR]

Each section runs in a process of its own with its own time budget (a crash or an out-of-memory error
in one leaves the others' results), writes its figures and verdict as JSON, and the run ends with
``gpu_report.json`` and ``gpu_report.md`` (one table per section) in ``--out``, the markdown printed.
``--dry-run`` runs every section on tiny shapes on the CPU (Triton's interpreter for the kernels): the
rehearsal, so that a device call starts with a script that has already run end to end.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .report import markdown
from .shared import ROOT, Ctx, Section, card

# (name, what it proves, budget on the card in s, budget in the dry run in s). In the order they run; the
# budgets add up to what one device call can hold with the model builds.
SECTIONS = [
    ("kernels", "the CUDA tests", 75, 150),
    ("decode", "decode at the roofline (issue 29): profile, batches, long context, prefill, mixed steps", 120, 120),
    ("memory", "the memory plan against nvml on a pool filled up", 60, 60),
    ("full_pool", "preemption by recompute and by swap on a full pool; swap bandwidth", 50, 60),
    ("prefix", "time to first token of a 4,096-token prompt, cold and cached", 30, 40),
    ("fp8", "fp8 KV: blocks, decode speed, drift", 40, 60),
    ("inspector", "the engine process on CUDA, a reader consuming every batch", 70, 90),
    ("serving", "bench/serve_load.py against the 7B-shape model", 45, 90),
    ("window", "the real window, offscreen, on the card", 50, 90),
]
NAMES = [s[0] for s in SECTIONS]


def run_section(name: str, dry_run: bool, out: Path, budget_s: float) -> Section:
    """In this process (the child's side)."""
    module = importlib.import_module(f"bench.gpucheck.sec_{name}")
    title = next(t for n, t, *_ in SECTIONS if n == name)
    section = Section(name, title)
    ctx = Ctx(dry_run, out, budget_s)
    t0 = time.monotonic()
    try:
        module.run(ctx, section)
    except Exception as e:  # noqa: BLE001 - the section's verdict says what broke, the run goes on
        import traceback
        traceback.print_exc()
        section.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    section.seconds = time.monotonic() - t0
    return section


def spawn(name: str, dry_run: bool, out: Path, budget_s: float, limit_s: float) -> Section:
    """A section in its own process; a crash or a timeout (its budget + 30 s, at most ``limit_s``) becomes its
    verdict, with its log's last lines."""
    result = out / f"section_{name}.json"
    log = out / f"section_{name}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpucheck", "--section", name, "--out", str(out)]
    if dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - t0
    if result.exists():
        section = Section.from_json(json.loads(result.read_text()))
        section.seconds = seconds
        return section
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    why = f"did not finish in {limit_s:.0f} s" if rc == "timeout" else f"its process exited with {rc}"
    title = next(t for n, t, *_ in SECTIONS if n == name)
    return Section(name, title, seconds=seconds, error=f"{why}; last lines: {tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help=f"comma-separated sections ({', '.join(NAMES)})")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: the rehearsal")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the whole run's time (a device call's limit): a section gets at most what is left")
    ap.add_argument("--work", default=None, help="where sections write their JSON and logs (default: a temporary "
                                                 "folder, packed into OUT/gpu_logs.tar.gz at the end)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        budget = next((g if not args.dry_run else d) for n, _, g, d in SECTIONS if n == args.section)
        section = run_section(args.section, args.dry_run, out, budget)
        section.save(out / f"section_{args.section}.json")
        return 0
    names = NAMES if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        print(f"gpucheck: no section {', '.join(unknown)} (sections: {', '.join(NAMES)})", file=sys.stderr)
        return 2
    info = card()
    print(f"gpucheck: {info['name']}; torch {info['torch']}, triton {info['triton']}, "
          f"transformers {info['transformers']}, Python {info['python']}", flush=True)
    t0 = time.monotonic()
    sections = []
    # The device returns at most 8 files from OUT: sections write into a work folder, packed at the end.
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpucheck-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in names:
        budget = next((g if not args.dry_run else d) for n, _, g, d in SECTIONS if n == name)
        left = (args.deadline_s - (time.monotonic() - t0) - 15) if args.deadline_s else float("inf")
        if left < 20:
            title = next(t for n, t, *_ in SECTIONS if n == name)
            s = Section(name, title, error=f"not run: {left + 15:.0f} s of the run's {args.deadline_s:.0f} s left")
        else:
            s = spawn(name, args.dry_run, work, budget, min(budget + 30, left))
        print(f"gpucheck: {name}: {s.verdict} ({s.seconds:.0f} s)", flush=True)
        sections.append(s)
        for png in work.glob("gpu-*.png"):
            shutil.copy(png, out / png.name)
    report = {"card": info, "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M"),
              "seconds": time.monotonic() - t0, "sections": [s.to_json() for s in sections]}
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "gpu_report.md").write_text(text)
    with tarfile.open(out / "gpu_logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpucheck", filter=lambda t: None if t.name.endswith(".png") else t)
    print(text)
    return 0 if all(not s.verdict.startswith("FAIL") for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
