"""Soak of the window: ``kvscope --serve`` left open while clients come and go; both processes' memory.

    python bench/soak_window.py [--minutes 30] [--clients 6] [--xvfb] [--profile DIR [--tracemalloc 6]] [--quick]

The real app, started as a user starts it (``python -m kvscope --serve``: the Qt window process, the
engine process it spawns, the OpenAI-compatible server inside the engine process), offscreen or under
Xvfb (``--xvfb``), on the tiny random Llama of the tests (vocabulary 256, a byte-level tokenizer) saved
to a folder. ``--clients`` concurrent clients send requests without pause for ``--minutes``: prompts
with shared prefixes (three prefixes, 60% of the prompts), n = 1 or 2, half of them streaming, one
stream in five cut after a random number of chunks. Every ``--sample-s`` seconds both processes' RSS
is read. After the clients stop: the pool must come to rest (nothing running or waiting, no block in
use, by the server's /metrics), a greedy answer asked at the start must come back unchanged, and
SIGTERM must stop the app.

Reported: requests served, client errors, each process's RSS at start, after the warm-up and at the
end, its largest growth over any ``--window-minutes`` after the first ``--warmup-minutes`` and its
slope after the warm-up; bench/results/soak_window.json and .png (RSS over time). With ``--profile
DIR`` the window's process writes, every ``--profile-every`` seconds after the warm-up, what grew
since the warm-up ended (DIR/profile.txt): the length of each of the window's stores and object counts
by type; with ``--tracemalloc FRAMES`` too, the top allocation sites by traceback (it runs several times
slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.append(str(ROOT / "tests"))  # last: tests/kvscope must not hide kvscope
from ports import free_port  # noqa: E402 - the tests' one port picker

ENGINE_FLAGS = ["--num-gpu-blocks", "256", "--block-size", "16", "--max-num-seqs", "16", "--max-model-len", "512"]
GREEDY = {"prompt": [7, 42, 99, 3, 250, 18, 64, 1, 77, 150, 33, 201, 9, 120, 5, 88], "max_tokens": 24}
# The window's own process, started as ``kvscope`` is (``kvscope.cli.main``), with the profiler first if asked.
CHILD = """
import sys
prof = {prof!r}
if prof:
    sys.path.insert(0, {bench!r})
    import soak_window
    soak_window.start_profiler(**prof)
from kvscope.cli import main
sys.exit(main(sys.argv[1:]))
"""


# -- the profiler, inside the window's process (nothing here imports torch or Qt) -----------------------
_WINDOWS: list = []  # the window, kept by a wrapper of MainWindow.__init__ (profile runs only)


def start_profiler(out: str, warmup_s: float, every_s: float, frames: int = 0) -> None:
    """``frames``: 0, only the stores' lengths and the object counts (cheap); else tracemalloc's
    allocation sites too, with this many frames (it slows the window's process several times)."""
    import tracemalloc

    from kvscope.ui.main_window import MainWindow

    init = MainWindow.__init__

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        _WINDOWS.append(self)

    MainWindow.__init__ = keep
    if frames:
        tracemalloc.start(frames)
    threading.Thread(
        target=_profile_loop, args=(Path(out), warmup_s, every_s), name="soak-profiler", daemon=True
    ).start()


def _type_counts() -> dict[str, int]:
    import gc
    from collections import Counter

    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def memory_maps() -> dict[str, int]:
    """Resident bytes by kind of mapping: C malloc's heap (``[heap]``), anonymous mappings (pymalloc's
    arenas, large allocations, numpy), files."""
    out: dict[str, int] = {}
    kind = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                name = head[5] if len(head) > 5 else ""
                kind = "files" if name.startswith("/") else name or "anonymous"
            elif head[0] == "Rss:":
                out[kind] = out.get(kind, 0) + int(head[1]) * 1024
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def window_stores(win) -> dict[str, int]:
    """The length of every store of the window that could grow with steps, requests or events."""
    import gc

    h, m = win.history, win.diagnosis.misses
    out = {f"history.{k}": v for k, v in h.store_lengths().items()}
    out.update(
        {
            "history.nbytes": h.nbytes,
            "history.dropped_steps": h.dropped_steps,
            "diagnosis.misses": len(m.misses) if m else 0,
            "diagnosis.evicted": m.num_evicted if m else 0,
            "diagnosis.mirror": len(m.mirror) if m else 0,
            "diagnosis.ref": len(m.ref) if m else 0,
            "event_log.rows": win.events.model.rowCount(),
            "request_table.rows": win.requests.model.rowCount(),
            "window.errors": len(win.errors),
            "gc.objects": len(gc.get_objects()),
        }
    )
    return out


def _profile_loop(out: Path, warmup_s: float, every_s: float) -> None:
    import tracemalloc

    out.mkdir(parents=True, exist_ok=True)
    while not (_WINDOWS and _WINDOWS[-1].history.steps):  # the warm-up counts from the first step
        time.sleep(1)
    win = _WINDOWS[-1]
    t0 = time.monotonic()
    time.sleep(warmup_s)
    flt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    base = tracemalloc.take_snapshot().filter_traces(flt) if tracemalloc.is_tracing() else None
    base_counts, base_rss, base_stores, base_maps = _type_counts(), _rss(), window_stores(win), memory_maps()
    report = out / "profile.txt"
    while True:
        time.sleep(every_s)
        counts, stores = _type_counts(), window_stores(win)
        cur, _peak = tracemalloc.get_traced_memory()
        lines = [
            f"at {time.monotonic() - t0:.0f} s from the first step ({time.monotonic() - t0 - warmup_s:.0f} s "
            f"after the baseline): RSS {_rss() / 2**20:.0f} MiB (baseline {base_rss / 2**20:.0f}), traced "
            f"{cur / 2**20:.0f} MiB",
            "",
            "stores (now, baseline):",
        ]
        lines += [f"  {k}: {v:,} ({base_stores.get(k, 0):,})" for k, v in stores.items()]
        lines += ["", "resident memory by mapping, MiB (now, baseline):"]
        lines += [
            f"  {k}: {v / 2**20:,.1f} ({base_maps.get(k, 0) / 2**20:,.1f})"
            for k, v in memory_maps().items()
            if v > 2**20
        ]
        lines += ["", "object counts by type, largest growth:"]
        grew = sorted(((counts[k] - base_counts.get(k, 0), k) for k in counts), reverse=True)[:30]
        lines += [f"  {d:+,} {k} (now {counts[k]:,})" for d, k in grew]
        report.write_text("\n".join(lines) + "\n")
        if base is None:
            continue
        snap = tracemalloc.take_snapshot().filter_traces(flt)
        lines += ["", "allocation sites (traceback), largest growth:"]
        for s in snap.compare_to(base, "traceback")[:25]:
            lines.append(f"  {s.size_diff / 2**20:+.2f} MiB, {s.count_diff:+,} blocks (now {s.size / 2**20:.2f} MiB)")
            lines += [f"      {fr.filename}:{fr.lineno}" for fr in s.traceback[-6:]]
        report.write_text("\n".join(lines) + "\n")
        del snap


# -- the clients ----------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    done: int = 0  # complete answers
    cut: int = 0  # streams the client cut on purpose
    errors: int = 0
    error_text: list[str] = field(default_factory=list)
    output_tokens: int = 0

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_text) < 10:
            self.error_text.append(text[:300])


def _plan(rng: random.Random, prefixes: list[list[int]]) -> tuple[dict, int | None]:
    prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
    prompt = prefix + [rng.randrange(1, 256) for _ in range(rng.randint(4, 96))]
    n = rng.choice((1, 2))
    body = {
        "prompt": prompt,
        "max_tokens": rng.randint(4, 48),
        "n": n,
        "stream": rng.random() < 0.5,
        "temperature": 0.0 if n == 1 and rng.random() < 0.5 else 0.8,
        "seed": rng.randrange(10_000),
        "return_token_ids": True,
    }
    cut = rng.randint(1, body["max_tokens"] - 1) if body["stream"] and rng.random() < 0.2 else None
    return body, cut


async def _one(client, body: dict, cut: int | None, tally: Tally) -> None:
    import httpx

    tally.sent += 1
    try:
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return tally.error(f"{r.status_code} {r.text}")
            choices = r.json()["choices"]
            if len(choices) != body["n"] or any(c["finish_reason"] is None for c in choices):
                return tally.error(f"incomplete answer: {r.text}")
            tally.done += 1
            tally.output_tokens += sum(len(c["token_ids"]) for c in choices)
            return
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return tally.error(f"{r.status_code} {(await r.aread())!r}")
            chunks = finished = dones = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    dones += 1
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    return tally.error(str(ev["error"]))
                for c in ev["choices"]:
                    tally.output_tokens += len(c.get("token_ids") or ())
                    finished += c["finish_reason"] is not None
                chunks += 1
                if cut is not None and chunks >= cut:
                    tally.cut += 1
                    return  # leaving the block closes the connection mid-stream
            if dones != 1 or finished != body["n"]:
                return tally.error(f"stream ended with {finished} finish reasons and {dones} [DONE]")
            tally.done += 1
    except httpx.HTTPError as e:
        tally.error(f"{type(e).__name__}: {e}")


async def drive(url: str, clients: int, seconds: float, tally: Tally, seed: int = 0) -> None:
    import httpx

    rng0 = random.Random(seed)
    prefixes = [[rng0.randrange(1, 256) for _ in range(k)] for k in (16, 40, 72)]
    stop = time.monotonic() + seconds

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < stop:
                await _one(client, *_plan(rng, prefixes), tally)

    await asyncio.gather(*(client_loop(i) for i in range(clients)))


def greedy_answer(url: str) -> list[int]:
    import httpx

    r = httpx.post(f"{url}/v1/completions", timeout=120, json={**GREEDY, "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


# -- the app and its memory ---------------------------------------------------------------------------
def save_model(folder: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import byte_tokenizer, make_tiny_hf

    make_tiny_hf("llama").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def engine_pid(window_pid: int) -> int | None:
    import psutil

    for c in psutil.Process(window_pid).children():
        cmd = " ".join(c.cmdline())
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            return c.pid
    return None


def rss_mb(pid: int | None) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20 if pid else None
    except psutil.NoSuchProcess:
        return None


def growth(samples: list[tuple[float, float]], warmup_s: float, window_s: float) -> dict:
    """RSS at start, at the warm-up's end and at the end; the largest rise over any ``window_s`` that starts
    after the warm-up (a sample's RSS ``window_s`` later minus its own), and the slope after the warm-up."""
    pts = [(t, v) for t, v in samples if v is not None]
    after = [(t, v) for t, v in pts if t >= warmup_s]
    if not after:
        return {}
    span = after[-1][0] - after[0][0]
    window_s = min(window_s, span) or span
    rises = []
    for i, (t, v) in enumerate(after):
        later = [w for u, w in after[i:] if u >= t + window_s - 1e-6]
        if later:
            rises.append(later[0] - v)
    n = len(after)
    mt, mv = sum(t for t, _ in after) / n, sum(v for _, v in after) / n
    var = sum((t - mt) ** 2 for t, _ in after)
    slope = sum((t - mt) * (v - mv) for t, v in after) / var * 60 if var else 0.0
    return {
        "start_mb": pts[0][1],
        "after_warmup_mb": after[0][1],
        "end_mb": pts[-1][1],
        "peak_mb": max(v for _, v in pts),
        "window_minutes": window_s / 60,
        "max_growth_in_window_mb": max(rises, default=0.0),
        "slope_mb_per_min": slope,
    }


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="soak-window-"))
    model = tmp / "tiny-llama"
    save_model(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prof = (
        dict(
            out=str(Path(args.profile).resolve()),
            warmup_s=args.warmup_minutes * 60,
            every_s=args.profile_every,
            frames=args.tracemalloc,
        )
        if args.profile
        else None
    )
    argv = [
        sys.executable,
        "-c",
        CHILD.format(prof=prof, bench=str(BENCH)),
        "--serve",
        "--port",
        str(port),
        "--model",
        str(model),
        *ENGINE_FLAGS,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if args.xvfb:
        env.pop("QT_QPA_PLATFORM", None)
        argv = ["xvfb-run", "-a", "-s", "-screen 0 1920x1080x24", *argv]
    else:
        env["QT_QPA_PLATFORM"] = "offscreen"
    log = open(tmp / "app.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _soak(args, proc, url, tmp)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        print(f"the app's log: {tmp / 'app.log'}", file=sys.stderr)


def _window_pid(proc) -> int:
    """The Python process of the window (under xvfb-run, a grandchild)."""
    import psutil

    p = psutil.Process(proc.pid)
    for _ in range(200):
        for c in [p, *p.children(recursive=True)]:
            cmd = c.cmdline()
            if cmd and cmd[0] == sys.executable and "-c" in cmd and "multiprocessing" not in " ".join(cmd):
                return c.pid
        time.sleep(0.1)
    raise RuntimeError("the window's process did not start")


def _wait_ready(url: str, proc, timeout: float = 300) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _soak(args, proc, url: str, tmp: Path) -> dict:
    win_pid = _window_pid(proc)
    _wait_ready(url, proc)
    eng_pid = engine_pid(win_pid)
    first = greedy_answer(url)
    tally = Tally()
    samples: list[dict] = []
    t0 = time.monotonic()
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append(
                {
                    "t": time.monotonic() - t0,
                    "window_mb": rss_mb(win_pid),
                    "engine_mb": rss_mb(eng_pid),
                    "requests": tally.sent,
                    "done": tally.done,
                }
            )
            s = samples[-1]
            print(
                f"{s['t'] / 60:5.1f} min  window {s['window_mb']:7.1f} MB  engine {s['engine_mb'] or 0:7.1f} MB  "
                f"{s['done']:,} answered",
                flush=True,
            )
            if stop.wait(args.sample_s):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    asyncio.run(drive(url, args.clients, args.minutes * 60, tally))
    seconds = time.monotonic() - t0
    stop.set()
    sampler.join()
    # at rest: nothing running or waiting, no block in use
    rest = {}
    for _ in range(120):
        rest = metrics(url)
        if (
            rest.get("vllm:num_requests_running") == 0
            and rest.get("vllm:num_requests_waiting") == 0
            and rest.get("vllm:kv_cache_usage_perc") == 0
        ):
            break
        time.sleep(0.5)
    last = greedy_answer(url)
    final = {"window_mb": rss_mb(win_pid), "engine_mb": rss_mb(eng_pid)}
    proc_sig = time.monotonic()
    os.kill(win_pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    for _ in range(100):  # the engine process sees its pipe close and goes
        if rss_mb(eng_pid) is None:
            break
        time.sleep(0.1)
    engine_gone = rss_mb(eng_pid) is None
    warm, window = args.warmup_minutes * 60, args.window_minutes * 60
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "display": "xvfb" if args.xvfb else "offscreen",
        "engine_flags": " ".join(ENGINE_FLAGS),
        "sample_s": args.sample_s,
        "warmup_minutes": args.warmup_minutes,
        "requests_sent": tally.sent,
        "requests_answered": tally.done,
        "streams_cut": tally.cut,
        "client_errors": tally.errors,
        "errors_text": tally.error_text,
        "output_tokens": tally.output_tokens,
        "seconds": seconds,
        "req_s": tally.done / seconds,
        "pool_at_rest": rest.get("vllm:num_requests_running") == 0
        and rest.get("vllm:num_requests_waiting") == 0
        and rest.get("vllm:kv_cache_usage_perc") == 0,
        "greedy_unchanged": first == last,
        "greedy_tokens": len(first),
        "sigterm_exit_code": code,
        "sigterm_seconds": time.monotonic() - proc_sig,
        "engine_gone_after": engine_gone,
        "window": growth([(s["t"], s["window_mb"]) for s in samples], warm, window),
        "engine": growth([(s["t"], s["engine_mb"]) for s in samples], warm, window),
        "at_rest_mb": final,
        "samples": samples,
    }
    return result


def plot(result: dict, path: Path, before: dict | None = None) -> None:
    """RSS over time; ``before``: another run's results (the window before its stores were bounded), dashed."""
    sys.path.insert(0, str(BENCH))
    from common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    top = max(x["window_mb"] or 0 for x in s)
    if before is not None:
        b = before["samples"]
        ax.plot(
            [x["t"] / 60 for x in b],
            [x["window_mb"] for x in b],
            color="#9d9d9d",
            lw=1.5,
            ls="--",
            label=f"window process, {before.get('label', 'before')}",
        )
        top = max(top, max(x["window_mb"] or 0 for x in b))
    ax.plot(t, [x["window_mb"] for x in s], label="window process", color="#4c78a8", lw=2)
    ax.plot(t, [x["engine_mb"] for x in s], label="engine process", color="#f58518", lw=2)
    ax.axvline(result["warmup_minutes"], color="grey", ls=":", lw=1)
    ax.set_xlabel("minutes of served load")
    ax.set_ylabel("RSS (MB)")
    ax.set_xlim(0, max(t[-1], 1))
    ax.set_ylim(0, top * 1.15)
    ax.set_title(
        f"kvscope --serve, {result['clients']} clients: {result['requests_answered']:,} requests in "
        f"{result['minutes']:g} min ({result['display']})",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right" if before is None else "center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--warmup-minutes", type=float, default=5.0)
    ap.add_argument("--window-minutes", type=float, default=10.0)
    ap.add_argument("--xvfb", action="store_true", help="run the window under xvfb-run (else offscreen)")
    ap.add_argument("--profile", metavar="DIR", help="tracemalloc in the window process; DIR/profile.txt")
    ap.add_argument("--profile-every", type=float, default=60.0)
    ap.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="with --profile: also tracemalloc's allocation sites, FRAMES deep (slow)",
    )
    ap.add_argument("--quick", action="store_true", help="2 minutes, 30 s of warm-up (CI-sized)")
    ap.add_argument("--name", default="soak_window", help="the results' file name in bench/results")
    ap.add_argument("--before", metavar="JSON", help="another run's results, drawn dashed (e.g. before a fix)")
    ap.add_argument("--label", default="", help="what this run is, for a later --before (e.g. 'before the bounds')")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.warmup_minutes, args.window_minutes = 2.0, 0.5, 1.0
    result = run(args)
    sys.path.insert(0, str(BENCH))
    from common import RESULTS, plot_path, write_results

    quick = args.quick
    if args.label:
        result["label"] = args.label
    write_results(args.name, result, quick)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    plot(result, plot_path(args.name, quick), before)
    if before is not None:
        result["before"] = {
            k: before[k] for k in ("label", "minutes", "requests_answered", "window", "engine") if k in before
        }
        write_results(args.name, result, quick)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    print(f"results: {(RESULTS / 'quick' if quick else RESULTS) / args.name}.json and .png")
    ok = result["client_errors"] == 0 and result["pool_at_rest"] and result["greedy_unchanged"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
