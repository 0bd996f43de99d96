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
import gc
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

import torch

from engine.messages import one_line

from .report import markdown
from .shared import ROOT, Ctx, Section, card

# (name, what it proves, budget on the card in s, budget in the dry run in s), in the order they run. The budgets
# fit one device call of about five minutes with the model builds.
SECTIONS = [
    ("decode", "decode at the roofline (issue 29): profile, batches, prefill, mixed steps", 70, 120),
    ("memory", "the memory plan against nvml on a pool filled up", 30, 60),
    ("prefix", "time to first token of a 4,096-token prompt, cold and cached", 12, 40),
    ("fp8", "fp8 KV: blocks, decode speed, drift", 25, 60),
    ("serving", "bench/serve_load.py against the 7B-shape model", 25, 90),
    ("full_pool", "preemption by recompute and by swap on a full pool; swap bandwidth", 20, 60),
    ("inspector", "the engine process on CUDA, a reader consuming every batch", 45, 90),
    ("window", "the real window, offscreen, on the card", 35, 90),
    # Last on the card: bench/gpu_kernels.py and the kernels' whole test file ran on it earlier in the session.
    ("kernels", "the fused engine's CUDA tests", 25, 150),
]
NAMES = [s[0] for s in SECTIONS]
# Sections that share one process (and its random 7B model, built once); each still has its own budget and
# verdict. A crash there costs the group's later sections, which are reported as not finished.
GROUPS = [("decode", "memory", "prefix", "fp8", "serving", "full_pool"), ("inspector",), ("window",), ("kernels",)]


def budget_of(name: str, dry_run: bool) -> float:
    return next((d if dry_run else g) for n, _, g, d in SECTIONS if n == name)


def title_of(name: str) -> str:
    return next(t for n, t, *_ in SECTIONS if n == name)


def run_section(name: str, dry_run: bool, out: Path, budget_s: float) -> Section:
    """In this process (the child's side)."""
    module = importlib.import_module(f"bench.gpucheck.sec_{name}")
    section = Section(name, title_of(name))
    ctx = Ctx(dry_run, out, budget_s)
    t0 = time.monotonic()
    try:
        module.run(ctx, section)
    except Exception as e:  # noqa: BLE001 - the section's verdict says what broke, the run goes on
        import traceback

        traceback.print_exc()
        section.error = one_line(e, with_type=True)[:300]
    section.seconds = time.monotonic() - t0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return section


def spawn(names: list[str], dry_run: bool, work: Path, limit_s: float) -> list[Section]:
    """A group of sections in one process; a crash or a timeout (``limit_s``) becomes the verdict of each
    section that had not finished, with the log's last lines."""
    results = [work / f"section_{n}.json" for n in names]
    for r in results:
        r.unlink(missing_ok=True)
    log = work / f"group_{names[0]}.log"
    cmd = [sys.executable, "-m", "bench.gpucheck", "--section", ",".join(names), "--out", str(work)]
    if dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    why = f"did not finish in {limit_s:.0f} s" if rc == "timeout" else f"its process exited with {rc}"
    out = []
    for name, result in zip(names, results):
        if result.exists():
            out.append(Section.from_json(json.loads(result.read_text())))
        else:
            out.append(Section(name, title_of(name), seconds=time.monotonic() - t0, error=f"{why}; last lines: {tail}"))
    return out


def write_report(out: Path, work: Path, info: dict, dry_run: bool, t0: float, sections: list[Section]) -> str:
    sections = sorted(sections, key=lambda s: NAMES.index(s.name))
    report = {
        "card": info,
        "dry_run": dry_run,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": time.monotonic() - t0,
        "sections": [s.to_json() for s in sections],
    }
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "gpu_report.md").write_text(text)
    with tarfile.open(out / "gpu_logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpucheck", filter=lambda t: None if t.name.endswith(".png") else t)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help=f"comma-separated sections ({', '.join(NAMES)})")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: the rehearsal")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="the whole run's time (a device call's limit): a section gets at most what is left",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="where sections write their JSON and logs (default: a temporary "
        "folder, packed into OUT/gpu_logs.tar.gz at the end)",
    )
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:  # the child's side: each section in turn, its JSON written as soon as it is done
        for name in args.section.split(","):
            section = run_section(name, args.dry_run, out, budget_of(name, args.dry_run))
            section.save(out / f"section_{name}.json")
        return 0
    names = NAMES if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        print(f"gpucheck: no section {', '.join(unknown)} (sections: {', '.join(NAMES)})", file=sys.stderr)
        return 2
    info = card()
    print(
        f"gpucheck: {info['name']}; torch {info['torch']}, triton {info['triton']}, "
        f"transformers {info['transformers']}, Python {info['python']}",
        flush=True,
    )
    t0 = time.monotonic()
    sections = []
    # The device returns at most 8 files from OUT: sections write into a work folder, packed at the end.
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpucheck-"))
    work.mkdir(parents=True, exist_ok=True)
    for group in GROUPS:
        todo = [n for n in group if n in names]
        if not todo:
            continue
        left = (args.deadline_s - (time.monotonic() - t0) - 15) if args.deadline_s else float("inf")
        if left < 15:
            done = [
                Section(n, title_of(n), error=f"not run: the run's {args.deadline_s:.0f} s were spent") for n in todo
            ]
        else:
            done = spawn(todo, args.dry_run, work, min(sum(budget_of(n, args.dry_run) for n in todo) + 30, left))
        for s in done:
            print(f"gpucheck: {s.name}: {s.verdict} ({s.seconds:.0f} s)", flush=True)
        sections += done
        for png in work.glob("gpu-*.png"):
            shutil.copy(png, out / png.name)
        text = write_report(out, work, info, args.dry_run, t0, sections)  # after each group: a kill leaves it
    print(text)
    return 0 if all(not s.verdict.startswith("FAIL") for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
