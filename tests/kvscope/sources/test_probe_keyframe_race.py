"""A subscriber is subscribed before the keyframe's lock is let go (``ProbeIO._send_keyframe``).

vLLM's engine core ends a step under the probe's lock: with nobody subscribed it drops the step's ops (the next
subscriber starts from a keyframe). A subscriber added only after its keyframe was sent left a window in which a
step ended, found nobody, and dropped ops the keyframe did not hold: its requests' rows then came whole and their
blocks' ref counts never did (CI, once in a while: "use_after_free (ref count 0, tables hold 1)" after a vLLM
restart). The keyframe also goes out under that lock: the engine core's thread sends its steps itself, and a step
that ended meanwhile would reach the subscriber before the keyframe it follows. Played here with the probe's I/O
object and a stand-in probe: a step ends on another thread at the moment the keyframe goes out."""

from __future__ import annotations

import threading

from kvscope_vllm_probe.probe_io import ProbeIO, _Peer


class StandInProbe:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def flush_between(self):
        return None

    def keyframe(self):
        return "keyframe"


def test_a_step_ending_while_the_keyframe_goes_out_is_the_new_subscribers():
    io = ProbeIO.__new__(ProbeIO)  # its sockets aside: the order of subscribing and sending is what is tested
    io.probe = StandInProbe()
    io.subscribed, io.peers, io._last_keyframe = set(), {b"kvscope": _Peer("kvscope")}, 0.0
    seen: list[bool] = []
    order: list[str] = []
    steps: list[threading.Thread] = []

    def end_step() -> None:  # vLLM's engine core: a step ends, under the lock, and asks who listens
        with io.probe.lock:
            seen.append(io.has_subscribers)
            order.append("step")

    def send(ident: bytes, data) -> None:
        t = threading.Thread(target=end_step)
        t.start()
        t.join(0.2)  # it waits for the lock the keyframe is sent under
        steps.append(t)
        order.append("keyframe")

    io._send = send
    io._send_keyframe(b"kvscope")
    steps[0].join(5)
    assert seen == [True]  # the step's ops go to the subscriber
    assert order == ["keyframe", "step"]  # after its keyframe
    assert b"kvscope" in io.subscribed
