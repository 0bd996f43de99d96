"""The probe switched off and on again inside one vLLM process, for the bench (``probe_steps.py --interleave``).

Two processes, one probed and one not, do not run at the same speed on a shared machine even when their code is the
same: on 2026-12-07 this machine's bare step went from 2.8 to 5.6 ms median within twenty minutes, and two probed
runs a minute apart measured 3.1 and 5.2 ms, their end-of-step work alike (0.08 and 0.22 ms). A cost taken as
the difference of two such runs is mostly the machine's. Here one process takes turns instead, a whole cycle of
the load's steps with the probe and one without, so both sides share the process's memory, caches and the machine's
minute.

Off is vLLM as it runs with no probe: the scheduler's probe is unset (its subclass's methods then only call
vLLM's), the recorder's instance wrappers are removed and the class hooks (``KVCacheBlock.__setattr__``, the hash
map's ``insert`` and ``pop``) are put back as vLLM defines them. On puts all of them back, and the probe forgets
what it sent, as it does when a subscriber leaves: the next step sends every row whole (a cycle that is not timed).
"""

from __future__ import annotations

_MISSING = object()


class ProbeSwitch:
    def __init__(self, block_cls: type, map_cls: type) -> None:
        """Before the scheduler is made: vLLM's own class attributes, as the probe will find them."""
        self.classes = (block_cls, map_cls)
        self.own = {(c, n): c.__dict__.get(n, _MISSING) for c, n in self._names()}
        self.probed: dict = {}
        self.scheduler = None
        self.probe = None

    def _names(self):
        block_cls, map_cls = self.classes
        return ((block_cls, "__setattr__"), (map_cls, "insert"), (map_cls, "pop"))

    def attach(self, scheduler) -> None:
        """After the scheduler is made (the probe installed): its hooks, to put back."""
        self.scheduler, self.probe = scheduler, scheduler._kvscope_probe
        self.probed = {(c, n): c.__dict__.get(n, _MISSING) for c, n in self._names()}

    def _set(self, attrs: dict) -> None:
        for (c, n), v in attrs.items():
            if v is _MISSING:
                if n in c.__dict__:
                    delattr(c, n)
            else:
                setattr(c, n, v)

    def off(self) -> None:
        p = self.probe
        with p.lock:
            self.scheduler._kvscope_probe = None
            p.recorder.uninstall()
            self._set(self.own)
        # nothing of the probe's is left in vLLM's way
        assert not p.recorder._saved and all(c.__dict__.get(n, _MISSING) is v for (c, n), v in self.own.items())

    def on(self) -> None:
        p = self.probe
        with p.lock:
            self._set(self.probed)
            rec = p.recorder
            rec.take()  # whatever was recorded before the switch went off
            rec.loose.clear()
            rec.install()
            p.rows.forget()
            self.scheduler._kvscope_probe = p
