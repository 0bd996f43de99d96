"""Inspector cost: engine steps/s bare, with snapshots and events recorded, and with the window attached.

    python bench/inspector_cost.py [--quick]

Batches of 32 requests (prompts 16-128, outputs 32-96 tokens, fixed seeds) on the tiny random
Llama, whose forward is fast enough that the inspector's own overhead shows (the worst case: on
SmolLM2 or a 7B model on a GPU the model step dominates). Four ways: ``LLMEngine.step`` alone; a
``LiveSource`` (what --headless runs: a snapshot and the events after every step); the offscreen
window at full speed with the engine on a thread (``--engine-thread``), and with the engine in its
own process (what ``kvscope`` runs; the window redraws at most ~30 times a second). Every batch a
mode runs comes right after the bare engine ran it, and "x bare" is the median of those pairs.
Also the grid's redraw time at 16 k, 262 k and 1 M blocks, and
(``snapshot_scale``) at 2,912, 65,536 and 1,048,576 blocks with 256 requests of steady traffic: a
snapshot's cost, the timeline's memory after 10,000 steps (2,000 at 1 M blocks) and a scrub's time.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from common import engine_for, length_mix, main, pyplot, random_prompts, save_figure, table, tiny_model, write_results  # noqa: E402
from engine import SamplingParams  # noqa: E402

ROUNDS = 7
BATCHES = 3  # three different batches of 32 requests a round


def workload(n: int, seed: int = 22):
    mix = length_mix(n, seed - 1, (16, 128), (32, 96))
    prompts = random_prompts([p for p, _ in mix], tiny_model()[0].config.vocab_size, seed=seed)
    return [(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)) for p, (_, o) in zip(prompts, mix)]


def new_engine():
    return engine_for(tiny_model(), block_size=16, num_gpu_blocks=1024, max_num_seqs=64)


def bare(reqs) -> tuple[int, float]:
    """One batch on a fresh engine: (steps, seconds of stepping)."""
    engine = new_engine()
    for p, sp in reqs:
        engine.add_request(p, sp)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return engine.step_count, time.perf_counter() - t0


class SessionRunner:
    """A ``LiveSource`` (what --headless runs) over one engine, batch after batch."""

    def __init__(self) -> None:
        from kvscope.sources.live import LiveSource

        self.s = LiveSource(new_engine())

    def run(self, reqs) -> tuple[int, float]:
        for p, sp in reqs:
            self.s.inject(p, sp)
        first = self.s.step_count
        t0 = time.perf_counter()
        while self.s.has_work():
            self.s.step()
        return self.s.step_count - first, time.perf_counter() - t0

    def close(self) -> None:
        self.s.close()


class WindowRunner:
    """The offscreen window at full speed; each ``run`` injects a batch and runs it to its end."""

    def __init__(self, win, load_timeout_s: float) -> None:
        from PySide6.QtWidgets import QApplication

        self.app, self.win = QApplication.instance(), win
        win.show()
        win.start()
        deadline = time.time() + load_timeout_s
        while (win.info is None or win.latest is None) and time.time() < deadline:
            self.app.processEvents()
            time.sleep(0.01)
        if win.latest is None:
            raise SystemExit("inspector_cost: the window's engine did not load")
        win.speed.setCurrentText("max")

    def run(self, reqs) -> tuple[int, float]:
        """The batch from Run to the engine's own pause at its end, waited for in Qt's event loop (no polling:
        the window's process does only what the window does)."""
        from PySide6.QtCore import QEventLoop

        from kvscope.ui.worker import InjectSpec

        app, win = self.app, self.win
        win.inject([InjectSpec(p, sp) for p, sp in reqs])
        h = win.history
        while h.counters_at(h.steps[-1]).get("num_requests_waiting", 0) < len(reqs):
            app.processEvents()
        first = h.steps[-1]
        loop = QEventLoop()
        paused = lambda on: None if on else loop.quit()  # noqa: E731
        win.worker.running_changed.connect(paused)
        t0 = time.perf_counter()
        win.toggle_run()
        loop.exec()
        dt = time.perf_counter() - t0
        win.worker.running_changed.disconnect(paused)
        c = h.counters_at(h.steps[-1])
        if c.get("num_requests_running") or c.get("num_requests_waiting"):
            raise SystemExit("inspector_cost: the window's engine paused before the batch's end")
        return h.steps[-1] - first, dt

    def close(self) -> None:
        self.win.shutdown()
        self.win.close()


def thread_window() -> WindowRunner:
    """The window with the engine on its thread (``--engine-thread``)."""
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from kvscope.sources.live import LiveSource
    from kvscope.ui.main_window import MainWindow

    QApplication.instance() or QApplication([])
    win = MainWindow(lambda _scenario: LiveSource(new_engine()), QSettings(os.devnull, QSettings.Format.IniFormat))
    return WindowRunner(win, 60)


def process_window() -> WindowRunner:
    """The window as ``kvscope`` runs it: the engine in its own process, snapshots through shared memory."""
    import tempfile

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from engine import EngineConfig
    from kvscope.runtime.build import SourceSpec
    from kvscope.ui.main_window import MainWindow
    from kvscope.ui.worker import ProcessBackend

    folder = tempfile.mkdtemp(prefix="kvscope-tiny-")
    tiny_model()[0].save_pretrained(folder)
    QApplication.instance() or QApplication([])
    spec = SourceSpec(EngineConfig(model=folder, block_size=16, num_gpu_blocks=1024, max_num_seqs=64))
    win = MainWindow(ProcessBackend(spec), QSettings(os.devnull, QSettings.Format.IniFormat))
    return WindowRunner(win, 120)


def run(quick: bool) -> dict:
    from engine.gc_policy import tune_gc
    from kvscope.runtime.engine_process import leave_a_core_to_the_window

    tune_gc()  # as kvscope's window and engine processes do (the engine process after each load)
    # The bare engine runs with the CPU threads the engine process gives itself (one core fewer than the
    # machine's; the environment, which the engine process inherits, says the same)
    threads = leave_a_core_to_the_window()
    batches = [workload(8 if quick else 32, 22 + i) for i in range(1 if quick else BATCHES)]
    modes = (
        ("LiveSource: + snapshot and events", SessionRunner),
        ("window, engine on a thread (--engine-thread)", thread_window),
        ("window, engine in its own process (kvscope)", process_window),
    )
    # Each batch of a mode runs just after the bare engine ran the same batch, and the ratio is taken
    # per pair: one run alone varies by up to 1.5x on this shared machine, in spells of seconds, so
    # rounds of whole modes in turn moved a mode's median by +-0.1 from one run to the next.
    bare_runs: list[tuple[int, float]] = []
    runs: dict[str, list[tuple[int, float]]] = {label: [] for label, _ in modes}
    ratios: dict[str, list[float]] = {label: [] for label, _ in modes}
    for _ in range(1 if quick else ROUNDS):
        for label, open_mode in modes:
            runner = open_mode()
            # not timed: the first batch after a window opens ran beside its engine process still settling
            # (the bare engine's run next to it was up to 2x slower than the rest)
            runner.run(batches[0])
            for reqs in batches:
                b = bare(reqs)
                m = runner.run(reqs)
                bare_runs.append(b)
                runs[label].append(m)
                ratios[label].append((m[0] / m[1]) / (b[0] / b[1]))
            runner.close()

    def row(label: str, done: list[tuple[int, float]], r: list[float]) -> dict:
        steps, dt = sorted(done, key=lambda x: x[0] / x[1])[len(done) // 2]
        r = sorted(r)
        return {
            "mode": label,
            "steps": steps,
            "steps_s": steps / dt,
            "ms_per_step": 1000 * dt / steps,
            "pairs": len(r),
            "vs_bare": r[len(r) // 2],
            "vs_bare_range": [r[0], r[-1]],
            "vs_bare_quartiles": [r[len(r) // 4], r[(3 * len(r)) // 4]],
        }

    rows = [row("engine.step() alone", bare_runs, [1.0] * len(bare_runs))]
    rows += [row(label, runs[label], ratios[label]) for label, _ in modes]
    from grid_redraw import measure

    grid = measure(sizes=(16_384, 262_144) if quick else (16_384, 262_144, 1_048_576), repeats=5 if quick else 20)
    import snapshot_scale

    scale = snapshot_scale.run(quick)["rows"]
    result = {
        "model": "tiny random Llama",
        "torch_threads": threads,
        "requests_per_batch": len(batches[0]),
        "batches": len(batches),
        "rounds": 1 if quick else ROUNDS,
        "rows": rows,
        "grid_redraw": grid,
        "scale": scale,
    }
    write_results("inspector_cost", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3))
    ax[0].barh([r["mode"] for r in rows][::-1], [r["ms_per_step"] for r in rows][::-1], color="#2a7")
    ax[0].set_xlabel("ms per engine step (tiny model)")
    ax[1].bar([f"{g['blocks'] // 1024}k" for g in grid], [g["median_ms"] for g in grid], color="#c84")
    ax[1].set_ylabel("grid redraw, ms (median)")
    ax[1].set_xlabel("blocks in the pool")
    save_figure(fig, "inspector_cost", quick)
    print(
        table(
            rows,
            [
                ("mode", "mode", ""),
                ("steps_s", "steps/s", ".1f"),
                ("ms_per_step", "ms/step", ".2f"),
                ("vs_bare", "x bare (median of pairs)", ".2f"),
            ],
        )
    )
    print(table(grid, [("blocks", "blocks", ",d"), ("median_ms", "grid redraw ms (median)", ".1f")]))
    return result


if __name__ == "__main__":
    main(run, __doc__)
