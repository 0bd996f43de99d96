"""Scenario files (resources/scenarios/*.json): engine settings plus a timed list of requests.

Format (JSON), every field but ``requests`` optional::

    {"title": "...", "description": "one paragraph", "watch": "what to watch, in a few sentences",
     "notes": [{"at": 1, "text": "what just happened at step 1"}, {"at": 3, "text": "..."}],
     "config": {"block_size": 4, "num_gpu_blocks": 64, "preemption_mode": "swap", "fault": "abort-leak"},
     "steps": 80,
     "requests": [
        {"at": 0, "prompt": "text" | [token ids] | [chat messages], "max_tokens": 32, "n": 1,
         "temperature": 0.0, "seed": null, "copies": 1, "abort_at": null, "beam_width": 0},
        {"at": 0, "conversation": {"system": "...", "turns": ["q1", "q2"]}, "max_tokens": 24}
     ]}

``at`` and ``abort_at`` are engine step numbers. A note's ``at`` is the step number the window
shows (the state after that many steps); a note holds until the next one. A conversation sends each turn as
the whole chat so far (earlier replies included), when the previous turn finishes.
No Qt here: the headless mode and the window's worker both drive it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine import LLMEngine, SamplingParams
from engine.outputs import StepOutput

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "resources" / "scenarios"
CONFIG_KEYS = {"block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
               "enable_prefix_caching", "preemption_mode", "num_cpu_blocks", "swap_space", "fault", "seed"}


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json"))


@dataclass
class Scenario:
    name: str
    title: str
    description: str
    config: dict
    steps: int | None
    requests: list[dict]
    watch: str = ""
    notes: list[tuple[int, str]] = field(default_factory=list)  # (step, text), sorted by step


def load_scenario(name_or_file: str) -> Scenario:
    p = Path(name_or_file)
    if not (p.suffix == ".json" and p.is_file()):
        p = SCENARIO_DIR / f"{name_or_file}.json"
    if not p.is_file():
        raise ValueError(f"unknown scenario {name_or_file!r}; available: {', '.join(available())}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read scenario {p}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise ValueError(f"scenario {p} needs a 'requests' list")
    bad = set(data.get("config", {})) - CONFIG_KEYS
    if bad:
        raise ValueError(f"scenario {p}: unknown config keys {sorted(bad)}")
    return Scenario(p.stem, data.get("title", p.stem), data.get("description", ""), data.get("config", {}),
                    data.get("steps"), data["requests"], str(data.get("watch", "")), _notes(p, data.get("notes", [])))


def _notes(p: Path, notes) -> list[tuple[int, str]]:
    if not isinstance(notes, list):
        raise ValueError(f"scenario {p}: 'notes' must be a list of {{\"at\": step, \"text\": \"...\"}}")
    out = []
    for i, n in enumerate(notes):
        at = n.get("at") if isinstance(n, dict) else None
        text = n.get("text") if isinstance(n, dict) else None
        if not (isinstance(at, int) and not isinstance(at, bool) and at >= 0 and isinstance(text, str)):
            raise ValueError(f"scenario {p}: notes[{i}] needs an integer 'at' >= 0 and a 'text' string, got {n!r}")
        out.append((at, text))
    return sorted(out, key=lambda t: t[0])


@dataclass
class _Conversation:
    messages: list[dict]
    turns: list[str]
    spec: dict
    request_id: str | None = None


@dataclass
class ScenarioRunner:
    """Injects the scenario's requests at their steps; call ``before_step`` / ``after_step``."""

    scenario: Scenario
    pending: list[dict] = field(init=False)
    aborts: dict[int, list[str]] = field(default_factory=dict)
    conversations: list[_Conversation] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending = sorted(self.scenario.requests, key=lambda r: r.get("at", 0))

    @staticmethod
    def params(spec: dict) -> SamplingParams:
        beam = int(spec.get("beam_width", 0))
        return SamplingParams(max_tokens=spec.get("max_tokens", 32), temperature=spec.get("temperature", 0.0),
                              n=spec.get("n", 1), seed=spec.get("seed"), top_p=spec.get("top_p", 1.0),
                              ignore_eos=spec.get("ignore_eos", False), use_beam_search=beam > 0,
                              beam_width=max(beam, 1))

    def before_step(self, engine: LLMEngine) -> list[str]:
        """Inject what is due at the coming step; returns the new request ids."""
        step = engine.step_count
        added = []
        while self.pending and self.pending[0].get("at", 0) <= step:
            spec = self.pending.pop(0)
            if "conversation" in spec:
                conv = spec["conversation"]
                msgs = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
                c = _Conversation(msgs, list(conv["turns"]), spec)
                self.conversations.append(c)
                added.append(self._next_turn(engine, c))
                continue
            for _ in range(spec.get("copies", 1)):
                rid = engine.add_request(spec["prompt"], self.params(spec))
                added.append(rid)
                if spec.get("abort_at") is not None:
                    self.aborts.setdefault(int(spec["abort_at"]), []).append(rid)
        for rid in self.aborts.pop(step, []):
            if engine.abort(rid):
                self.log.append(f"step {step}: aborted request {rid}")
        return added

    def _next_turn(self, engine: LLMEngine, c: _Conversation) -> str:
        c.messages.append({"role": "user", "content": c.turns.pop(0)})
        c.request_id = engine.add_request(list(c.messages), self.params(c.spec))
        return c.request_id

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        for o in out.finished:
            for c in self.conversations:
                if c.request_id == o.request_id and c.turns:
                    c.messages.append({"role": "assistant", "content": o.outputs[0].text})
                    self._next_turn(engine, c)

    def has_work(self, engine: LLMEngine) -> bool:
        """Requests still to inject (or conversation turns still to send)."""
        return bool(self.pending) or any(c.turns for c in self.conversations)

    def done(self, engine: LLMEngine) -> bool:
        return not self.has_work(engine) and not engine.has_unfinished()
