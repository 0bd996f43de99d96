"""Section kernels: the CUDA tests (Triton kernels compiled for real against the PyTorch reference; the
engine with Triton and CUDA graphs token-identical to transformers, caching on and off, beams)."""

from __future__ import annotations

import re
import subprocess
import sys

from .shared import ROOT, Ctx, Section, Table

# The kernels' own tests (test_triton_paged.py, test_fused_ops.py) ran on the card earlier in the session with
# bench/gpu_kernels.py; what a device call has time for is the engine over them, token for token.
GPU_TESTS = ["tests/engine/runner/test_fused_ops_engine.py"]
# The rehearsal proves the section's pytest run and its report on a short file: GPU_TESTS themselves run in the
# suite already (under the Triton interpreter), and the dry run took 11 s more of the suite's CPU running one again.
DRY_TESTS = ["tests/engine/runner/test_model_runner_cuda_path.py"]


def run(ctx: Ctx, section: Section) -> None:
    # a renamed test file would otherwise leave the device run with nothing to run, and a green section
    missing = [f for f in GPU_TESTS + DRY_TESTS if not (ROOT / f.split("::")[0]).exists()]
    section.check("test files missing", ", ".join(missing) or "none", "none", not missing)
    files = [f for f in (DRY_TESTS if ctx.dry_run else GPU_TESTS) if f not in missing]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "--timeout",
        str(int(ctx.left_s())),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.left_s() + 10)
    (ctx.out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    summary = next((ln for ln in reversed(proc.stdout.strip().splitlines()) if " in " in ln), "no summary")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)}
    section.tables.append(
        Table(
            "CUDA tests",
            [("files", "files", ""), ("passed", "passed", "d"), ("failed", "failed", "d"), ("skipped", "skipped", "d")],
            [
                {
                    "files": ", ".join(f.split("/")[-1] for f in files),
                    "passed": counts.get("passed", 0),
                    "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
                    "skipped": counts.get("skipped", 0),
                }
            ],
        )
    )
    section.data["summary"] = summary
    section.check("pytest exit code", proc.returncode, "0", proc.returncode == 0)
    if proc.returncode:
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))][:5]
        section.notes += failed
