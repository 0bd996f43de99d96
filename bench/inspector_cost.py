"""Inspector cost: engine steps/s bare, with snapshots and events recorded, and with the window attached.

    python bench/inspector_cost.py [--quick]

The same 32 requests (prompts 16-128, outputs 32-96 tokens, fixed seed) on the tiny random Llama,
whose forward is fast enough that the inspector's own overhead shows (the worst case: on SmolLM2
or a 7B model on a GPU the model step dominates). Three ways: ``LLMEngine.step`` alone; a
``Session`` (what the worker and --headless run: a snapshot and the events after every step);
the offscreen window running at full speed (the worker thread steps and snapshots; the window
redraws at most ~30 times a second). Also the grid's redraw time at 16 k, 262 k and 1 M blocks, and
(``snapshot_scale``) at 2,912, 65,536 and 1,048,576 blocks with 256 requests of steady traffic: a
snapshot's cost, the timeline's memory after 10,000 steps (2,000 at 1 M blocks) and a scrub's time.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from common import engine_for, length_mix, main, pyplot, random_prompts, save_figure, table, tiny_model, write_results  # noqa: E402
from engine import SamplingParams  # noqa: E402

ROUNDS = 5


def workload(n: int):
    mix = length_mix(n, 21, (16, 128), (32, 96))
    prompts = random_prompts([p for p, _ in mix], tiny_model()[0].config.vocab_size, seed=22)
    return [(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)) for p, (_, o) in zip(prompts, mix)]


def new_engine():
    return engine_for(tiny_model(), block_size=16, num_gpu_blocks=1024, max_num_seqs=64)


def bare(reqs) -> tuple[int, float]:
    engine = new_engine()
    for p, sp in reqs:
        engine.add_request(p, sp)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return engine.step_count, time.perf_counter() - t0


def session(reqs) -> tuple[int, float]:
    from kvscope.session import Session
    s = Session(new_engine())
    for p, sp in reqs:
        s.inject(p, sp)
    t0 = time.perf_counter()
    while s.has_work():
        s.step()
    return s.step_count, time.perf_counter() - t0


def _drive(win, reqs, load_timeout_s: float) -> tuple[int, float]:
    """Open ``win``, inject ``reqs``, run at full speed until every request is done: (steps, seconds)."""
    from PySide6.QtWidgets import QApplication

    from kvscope.worker import InjectSpec
    app = QApplication.instance()
    win.show()
    win.start()
    deadline = time.time() + load_timeout_s
    while (win.info is None or win.latest is None) and time.time() < deadline:
        app.processEvents()
        time.sleep(0.01)
    win.inject([InjectSpec(p, sp) for p, sp in reqs])
    while len(win.latest.snapshot.requests) < len(reqs):
        app.processEvents()
    win.speed.setCurrentText("max")
    first = win.latest.step
    t0 = time.perf_counter()
    win.toggle_run()

    def done() -> bool:
        c = win.latest.snapshot.counters
        return c["num_requests_running"] == 0 and c["num_requests_waiting"] == 0 and win.latest.step > first
    while not done():
        app.processEvents()
        time.sleep(0.001)
    dt = time.perf_counter() - t0
    steps = win.latest.step - first
    win.shutdown()
    win.close()
    return steps, dt


def window(reqs) -> tuple[int, float]:
    """The window with the engine on its thread (``--engine-thread``)."""
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from kvscope.main_window import MainWindow
    from kvscope.session import Session
    QApplication.instance() or QApplication([])
    win = MainWindow(lambda _scenario: Session(new_engine()), QSettings(os.devnull, QSettings.Format.IniFormat))
    return _drive(win, reqs, 60)


def window_process(reqs) -> tuple[int, float]:
    """The window as ``kvscope`` runs it: the engine in its own process, snapshots through shared memory."""
    import tempfile

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from engine import EngineConfig
    from kvscope.main_window import MainWindow
    from kvscope.sources.build import SourceSpec
    from kvscope.worker import ProcessBackend
    folder = tempfile.mkdtemp(prefix="kvscope-tiny-")
    tiny_model()[0].save_pretrained(folder)
    QApplication.instance() or QApplication([])
    spec = SourceSpec(EngineConfig(model=folder, block_size=16, num_gpu_blocks=1024, max_num_seqs=64))
    win = MainWindow(ProcessBackend(spec), QSettings(os.devnull, QSettings.Format.IniFormat))
    return _drive(win, reqs, 120)


def run(quick: bool) -> dict:
    from engine.gc_policy import tune_gc
    tune_gc()  # as kvscope's window and engine processes do (the engine process after each load)
    reqs = workload(8 if quick else 32)
    modes = (("engine.step() alone", bare), ("Session: + snapshot and events", session),
             ("window, engine on a thread (--engine-thread)", window),
             ("window, engine in its own process (kvscope)", window_process))
    # Rounds of all modes in turn, the median per mode: one run of a mode alone varied by up to 1.4x
    # on this shared machine (a slow spell then lands on all modes alike).
    runs: dict[str, list[tuple[int, float]]] = {label: [] for label, _ in modes}
    for _ in range(1 if quick else ROUNDS):
        for label, fn in modes:
            runs[label].append(fn(reqs))
    rows = []
    for label, _ in modes:
        steps, dt = sorted(runs[label], key=lambda r: r[0] / r[1])[len(runs[label]) // 2]
        rows.append({"mode": label, "steps": steps, "steps_s": steps / dt, "ms_per_step": 1000 * dt / steps,
                     "rounds": len(runs[label])})
    for r in rows:
        r["vs_bare"] = r["steps_s"] / rows[0]["steps_s"]
    from grid_redraw import measure
    grid = measure(sizes=(16_384, 262_144) if quick else (16_384, 262_144, 1_048_576), repeats=5 if quick else 20)
    import snapshot_scale
    scale = snapshot_scale.run(quick)["rows"]
    result = {"model": "tiny random Llama", "requests": len(reqs), "rows": rows, "grid_redraw": grid,
              "scale": scale}
    write_results("inspector_cost", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3))
    ax[0].barh([r["mode"] for r in rows][::-1], [r["ms_per_step"] for r in rows][::-1], color="#2a7")
    ax[0].set_xlabel("ms per engine step (tiny model)")
    ax[1].bar([f"{g['blocks'] // 1024}k" for g in grid], [g["median_ms"] for g in grid], color="#c84")
    ax[1].set_ylabel("grid redraw, ms (median)")
    ax[1].set_xlabel("blocks in the pool")
    save_figure(fig, "inspector_cost", quick)
    print(table(rows, [("mode", "mode", ""), ("steps_s", "steps/s", ".1f"), ("ms_per_step", "ms/step", ".2f"),
                       ("vs_bare", "x bare", ".2f")]))
    print(table(grid, [("blocks", "blocks", ",d"), ("median_ms", "grid redraw ms (median)", ".1f")]))
    return result


if __name__ == "__main__":
    main(run, __doc__)
