"""The window kinds whose source is stepped on the GUI thread, each opened through ``ui.host.host_window`` with a
``PollDriver``: an attached engine's forest, a fleet, a simulated fleet. (The main window, for kvscope's engine,
a replay, a probed vLLM or a workload, is ``ui.app.run_app``, through the same host.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvscope.ui.host import HostOptions, host_window
from kvscope.ui.poll_driver import PollDriver

ATTACH_SCREENSHOT_STEPS = 40  # polls before an attach or fleet screenshot without --steps
SIM_SCREENSHOT_EVENTS = 4000  # events a simulated fleet's screenshot plays without --steps

Decode = Callable[[Sequence[int]], str]


def run_attach(
    source,
    opts: HostOptions,
    interval: float = 0.1,
    steps: int | None = None,
    decode: Decode | None = None,
    before_step: Callable[[], None] | None = None,
) -> int:
    """An attached engine's prefix forest, polled every ``interval`` s (its source's polls must not wait)."""
    from kvscope.ui.views.prefix_forest import AttachWindow

    shots = steps if steps is not None else ATTACH_SCREENSHOT_STEPS
    return host_window(
        lambda: AttachWindow(source, decode),
        lambda win: PollDriver(win, source, interval, shots, opts.screenshot, before_step),
        opts,
    )


def run_fleet(
    source,
    opts: HostOptions,
    interval: float = 0.1,
    steps: int | None = None,
    tokenize: Callable[[str], list[int]] | None = None,
    decode: Decode | None = None,
    tokenizer_error: str | None = None,
    route: str | list[int] | None = None,
    before_step: Callable[[], None] | None = None,
) -> int:
    """A fleet of attached engines; ``route``: a prompt (text, or token ids) in the box from the start, answered
    as the caches change."""
    from kvscope.ui.views.fleet_view import FleetWindow

    def build() -> FleetWindow:
        win = FleetWindow(source, tokenize, decode, tokenizer_error)
        if route is not None:
            win.ask(route)
        return win

    shots = steps if steps is not None else ATTACH_SCREENSHOT_STEPS
    return host_window(build, lambda win: PollDriver(win, source, interval, shots, opts.screenshot, before_step), opts)


def run_sim_fleet(source, opts: HostOptions, steps: int | None = None) -> int:
    """A request trace over a simulated fleet, a slice of virtual time a tick (the window's speed); a screenshot
    plays ``steps`` events (default 4000) in one step and saves."""
    from kvscope.sources.fleet_sim import TICK_S
    from kvscope.ui.views.fleet_sim_view import SimFleetWindow

    def drive(win: SimFleetWindow) -> PollDriver:
        if opts.screenshot:
            source.play_events(steps if steps is not None else SIM_SCREENSHOT_EVENTS)
        driver = PollDriver(win, source, TICK_S, 1 if opts.screenshot else None, opts.screenshot)
        win.bind(driver)
        return driver

    return host_window(lambda: SimFleetWindow(source), drive, opts)
