"""Scenario files (resources/scenarios/*.json): engine settings plus a timed list of requests.

Format (JSON), every field but ``requests`` optional::

    {"title": "...", "description": "one paragraph", "watch": "what to watch, in a few sentences",
     "notes": [{"at": 1, "text": "what just happened at step 1", "requests": ["0"]},
               {"at": 3, "text": "...", "requests": ["0", "1"], "blocks": [9, 10, 11]}],
     "config": {"block_size": 4, "num_gpu_blocks": 64, "preemption_mode": "swap", "fault": "abort-leak"},
     "steps": 80,
     "requests": [
        {"at": 0, "prompt": "text" | [token ids] | [chat messages], "max_tokens": 32, "n": 1,
         "temperature": 0.0, "seed": null, "copies": 1, "abort_at": null, "beam_width": 0},
        {"at": 0, "conversation": {"system": "...", "turns": ["q1", "q2"]}, "max_tokens": 24}
     ]}

``at`` and ``abort_at`` are engine step numbers. A note's ``at`` is the step number the window
shows (the state after that many steps); a note holds until the next one. A note's ``requests`` (at most two:
the paper's figure draws two) and ``blocks`` are the lesson's subject from that step on: what the window selects
and its figure draws, as a teacher would point at them (``Subject``); a note without them keeps the subject
before it, and ``"requests": []`` ends it. A conversation sends each turn as
the whole chat so far (earlier replies included), when the previous turn finishes.
No Qt here: the headless mode and the window's worker both drive it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine import SamplingParams
from engine.config import check_value, config_fields, scenario_keys
from engine.inputs import check_text, is_chat, is_token_ids
from engine.outputs import StepOutput
from kvscope.history import SERIES

if TYPE_CHECKING:
    from engine import EngineConfig, LLMEngine

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "resources" / "scenarios"
CONFIG_KEYS = scenario_keys()  # every EngineConfig field but the machine's (model, tokenizer, device)
# the window's bottom panels; "miss": the miss explainer's answer for the lesson's request (in the Why? tab, and a
# panel of its own in presentation)
VIEWS = ("", "figure", "events", "diagnosis", "plots", "fragmentation", "miss")
PLOTTED = SERIES + ("ttft", "pool_bytes", "pool_used")  # what the Plots tab draws (the last three it derives)
MAX_STEP = 100_000  # "at" / "abort_at": a scenario must not idle the engine for ever
MAX_COPIES = 4096
REQUEST_KEYS = {
    "at",
    "prompt",
    "conversation",
    "max_tokens",
    "n",
    "temperature",
    "seed",
    "top_p",
    "copies",
    "abort_at",
    "beam_width",
    "ignore_eos",
}


# What a teacher looks for, by what the lesson shows: each alias names a scenario file (``--scenario ALIAS``).
ALIASES = {
    "one-request": "four-score",  # the paper's figure 4: one request's block table
    "two-requests": "four-score",  # figure 5: two requests' blocks interleave in one pool
    "sharing": "shared-system-prompt",
    "prefix-caching": "shared-system-prompt",
    "copy-on-write": "parallel-sampling",  # figure 6
    "cow": "parallel-sampling",
    "beams": "beam-search",
    "preemption": "pool-exhaustion",
    "swap": "pool-exhaustion",
    "leak": "leak-hunt",
    "chat": "multi-turn-chat",
}


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json"))


def aliases_of(name: str) -> list[str]:
    """The aliases of scenario ``name`` (what ``--list-scenarios`` and the tour write beside it)."""
    return [a for a, n in ALIASES.items() if n == name]


def scenario_listing() -> str:
    """``kvscope --list-scenarios``: each scenario with its aliases and its title, a line each."""
    lines = []
    for name in available():
        sc = load_scenario(name)
        also = aliases_of(name)
        lines.append(f"{name}{' (also ' + ', '.join(also) + ')' if also else ''}: {sc.title}")
    return "\n".join(lines)


MAX_SUBJECT_REQUESTS = 2  # the paper's figure draws one request or two side by side


@dataclass(frozen=True, slots=True)
class Subject:
    """What a lesson points at from step ``at`` on: the requests its figure draws and the blocks it names."""

    at: int
    requests: tuple[str, ...] = ()
    blocks: tuple[int, ...] = ()


def subject_at(subjects: list[Subject] | tuple[Subject, ...], step: int | None) -> Subject | None:
    """The subject in force at ``step`` (the last one at or before it), or None."""
    if step is None:
        return None
    return next((s for s in reversed(subjects) if s.at <= step), None)


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
    subjects: list[Subject] = field(default_factory=list)  # what the notes point at, sorted by step
    view: str = ""  # the window's panel that tells this scenario's story, brought to the front on load
    plot: str = ""  # with view "plots": the series whose plot the lesson reads, scrolled into view
    # a recorded probe trace of a real vLLM (kvscope --probe ... --trace) played instead of kvscope's engine
    probe_trace: str = ""


# A command-line engine flag that a scenario also sets: applied over the scenario's value (a student asks "what if
# the block size were 4?"; the run says so in one line), or refused with one line where the setting is the lesson
# itself. Every setting not named here is applied; one place, so the window and --headless decide alike.
REFUSED_OVER_SCENARIO = {
    "fault": "its lesson is the fault it switches on",  # a lab built on one fault: another makes its notes false
}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def scenario_config(
    config: EngineConfig, sc: Scenario, given: frozenset[str] | set[str] = frozenset()
) -> tuple[EngineConfig, list[str]]:
    """``config`` with the scenario's settings, except those the command line gave (``given``: the fields of
    ``config`` set by a flag), which are applied over the scenario's or refused (``REFUSED_OVER_SCENARIO``,
    a ``ValueError`` of one line). Returns the config and a line for each scenario setting a flag replaced."""
    refused = sorted(k for k in sc.config if k in given and k in REFUSED_OVER_SCENARIO)
    if refused:
        k = refused[0]
        raise ValueError(
            f"{_flag(k)} is refused with --scenario {sc.name}, which sets {k}={sc.config[k]!r}: "
            f"{REFUSED_OVER_SCENARIO[k]} (run it without {_flag(k)}, or {_flag(k)} with --inject)"
        )
    notices = [
        f"{_flag(k)} {getattr(config, k)} applied over scenario {sc.name}'s {k}={sc.config[k]!r} (its notes "
        f"describe {sc.config[k]!r})"
        for k in sorted(sc.config)
        if k in given and getattr(config, k) != sc.config[k]
    ]
    merged = dataclasses.replace(config, **{k: v for k, v in sc.config.items() if k not in given})
    merged.validate()
    return merged, notices


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompt(prompt: object) -> None:
    """A prompt's shape (text, token ids or chat messages); the engine checks the rest (vocabulary, fit)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("'prompt' is empty")
        check_text(prompt, "'prompt'")
    elif is_chat(prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs a string 'role' and 'content'")
            check_text(m["content"], "a chat message")
    elif not is_token_ids(prompt):
        raise ValueError(
            f"'prompt' must be text, a non-empty list of token ids or of chat messages, got {json.dumps(prompt)[:60]}"
        )


def check_request(spec: object) -> None:
    """One request of a scenario file; raises ``ValueError`` naming the field."""
    if not isinstance(spec, dict):
        raise ValueError(f"must be an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - REQUEST_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; known: {', '.join(sorted(REQUEST_KEYS))}")
    for key, least, most in (
        ("at", 0, MAX_STEP),
        ("copies", 1, MAX_COPIES),
        ("abort_at", 0, MAX_STEP),
        ("beam_width", 0, None),
    ):
        if key not in spec or (key == "abort_at" and spec[key] is None):
            continue
        v = spec[key]
        if not _int(v) or v < least or (most is not None and v > most):
            bounds = f"in {least}..{most:,}" if most is not None else f">= {least}"
            raise ValueError(f"'{key}' must be an integer {bounds}, got {json.dumps(v)}")
    if ("prompt" in spec) == ("conversation" in spec):
        raise ValueError("needs a 'prompt' or a 'conversation' (one of them)")
    if "prompt" in spec:
        check_prompt(spec["prompt"])
    else:
        conv = spec["conversation"]
        if (
            not isinstance(conv, dict)
            or not isinstance(conv.get("turns"), list)
            or not conv["turns"]
            or not all(isinstance(t, str) and t.strip() for t in conv["turns"])
        ):
            raise ValueError("'conversation' needs 'turns', a non-empty list of non-empty strings")
        if not isinstance(conv.get("system", ""), str) or set(conv) - {"system", "turns"}:
            raise ValueError("'conversation' takes 'turns' and an optional string 'system'")
        for t in conv["turns"] + [conv.get("system", "")]:
            check_text(t, "a conversation turn")
    ScenarioRunner.params(spec)  # the sampling fields, by SamplingParams' own rules


def load_scenario(name_or_file: str) -> Scenario:
    """Read and check a scenario file; every problem is one line naming the file and the field."""
    p = Path(name_or_file)
    if not (p.suffix == ".json" and p.is_file()):
        p = SCENARIO_DIR / f"{ALIASES.get(name_or_file, name_or_file)}.json"
    if not p.is_file():
        raise ValueError(
            f"unknown scenario {name_or_file!r}; available: {', '.join(available())} (and the aliases "
            f"{', '.join(ALIASES)}: kvscope --list-scenarios)"
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read scenario {p}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise ValueError(f"scenario {p} needs a 'requests' list")
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"scenario {p}: 'config' must be an object")
    bad = set(config) - CONFIG_KEYS
    if bad:
        raise ValueError(
            f"scenario {p}: unknown config keys {sorted(bad)} (a scenario may set {', '.join(sorted(CONFIG_KEYS))})"
        )
    by_name = {f.name: f for f in config_fields()}
    for key, value in config.items():
        try:
            check_value(by_name[key], value)
        except ValueError as e:
            raise ValueError(f"scenario {p}: config: {e}") from None
    steps = data.get("steps")
    if steps is not None and (not _int(steps) or steps < 1):
        raise ValueError(f"scenario {p}: 'steps' must be an integer >= 1, got {json.dumps(steps)}")
    view = data.get("view", "")
    if view not in VIEWS:
        raise ValueError(f"scenario {p}: 'view' must be one of {', '.join(repr(v) for v in VIEWS)}, got {view!r}")
    plot = data.get("plot", "")
    if plot and (view != "plots" or plot not in PLOTTED):
        raise ValueError(
            f'scenario {p}: \'plot\' names a series of the Plots tab (with "view": "plots"): one of '
            f"{', '.join(PLOTTED)}, got {plot!r}"
        )
    for key in ("title", "description", "watch"):
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"scenario {p}: '{key}' must be a string")
    for i, spec in enumerate(data["requests"]):
        try:
            check_request(spec)
        except ValueError as e:
            raise ValueError(f"scenario {p}: request {i}: {e}") from None
    probe_trace = data.get("probe_trace", "")
    if probe_trace:
        trace = (p.parent / probe_trace) if isinstance(probe_trace, str) else None
        if trace is None or not trace.is_file() or data["requests"] or config:
            raise ValueError(
                f"scenario {p}: 'probe_trace' names a probe trace file beside it (and then the "
                f"scenario has no requests or config of its own)"
            )
        probe_trace = str(trace.resolve())
    return Scenario(
        p.stem,
        data.get("title", p.stem),
        data.get("description", ""),
        config,
        steps,
        data["requests"],
        data.get("watch", ""),
        *_notes(p, data.get("notes", []), config.get("num_gpu_blocks")),
        view=view,
        plot=plot,
        probe_trace=probe_trace,
    )


def _notes(p: Path, notes, num_blocks: int | None) -> tuple[list[tuple[int, str]], list[Subject]]:
    """The notes (step, text) and the subjects they name, each sorted by step."""
    if not isinstance(notes, list):
        raise ValueError(f'scenario {p}: \'notes\' must be a list of {{"at": step, "text": "..."}}')
    out, subjects = [], []
    for i, n in enumerate(notes):
        at = n.get("at") if isinstance(n, dict) else None
        text = n.get("text") if isinstance(n, dict) else None
        if not (isinstance(at, int) and not isinstance(at, bool) and at >= 0 and isinstance(text, str)):
            raise ValueError(f"scenario {p}: notes[{i}] needs an integer 'at' >= 0 and a 'text' string, got {n!r}")
        unknown = sorted(set(n) - {"at", "text", "requests", "blocks"})
        if unknown:
            raise ValueError(f"scenario {p}: notes[{i}]: unknown key(s) {unknown}; known: at, text, requests, blocks")
        out.append((at, text))
        if "requests" in n or "blocks" in n:
            reqs, blocks = n.get("requests", []), n.get("blocks", [])
            if (
                not isinstance(reqs, list)
                or len(reqs) > MAX_SUBJECT_REQUESTS
                or not all(isinstance(r, str) and r for r in reqs)
            ):
                raise ValueError(
                    f"scenario {p}: notes[{i}]: 'requests' is a list of at most {MAX_SUBJECT_REQUESTS} request ids "
                    f"(the figure draws one or two), got {json.dumps(reqs)}"
                )
            if not isinstance(blocks, list) or not all(
                _int(b) and 0 <= b and (num_blocks is None or b < num_blocks) for b in blocks
            ):
                pool = f" in 0..{num_blocks - 1}" if num_blocks else " >= 0"
                raise ValueError(f"scenario {p}: notes[{i}]: 'blocks' is a list of block ids{pool}, got {blocks!r}")
            subjects.append(Subject(at, tuple(reqs), tuple(blocks)))
    return sorted(out, key=lambda t: t[0]), sorted(subjects, key=lambda s: s.at)


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
        beam = spec.get("beam_width", 0)
        if not _int(beam) or beam < 0:
            raise ValueError(f"'beam_width' must be an integer >= 0, got {json.dumps(beam)}")
        return SamplingParams(
            max_tokens=spec.get("max_tokens", 32),
            temperature=spec.get("temperature", 0.0),
            n=spec.get("n", 1),
            seed=spec.get("seed"),
            top_p=spec.get("top_p", 1.0),
            ignore_eos=spec.get("ignore_eos", False),
            use_beam_search=beam > 0,
            beam_width=max(beam, 1),
        )

    def check(self, engine: LLMEngine) -> None:
        """Ask the engine about every request before the run (a prompt larger than the pool, a text prompt
        for a model without a tokenizer, ...): a bad scenario stops at load, not at step 40."""
        for i, spec in enumerate(self.scenario.requests):
            if "conversation" in spec:
                conv = spec["conversation"]
                prompt = ([{"role": "system", "content": conv["system"]}] if conv.get("system") else []) + [
                    {"role": "user", "content": conv["turns"][0]}
                ]
            else:
                prompt = spec["prompt"]
            try:
                engine.validate_request(prompt, self.params(spec))
            except ValueError as e:
                raise ValueError(f"scenario {self.scenario.name}: request {i} is refused: {e}") from None

    def _add(self, engine: LLMEngine, prompt, spec: dict) -> str:
        try:
            return engine.add_request(prompt, self.params(spec))
        except ValueError as e:
            i = self.scenario.requests.index(spec) if spec in self.scenario.requests else "?"
            raise ValueError(
                f"scenario {self.scenario.name}: request {i} is refused at step {engine.step_count}: {e}"
            ) from None

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
                rid = self._add(engine, spec["prompt"], spec)
                added.append(rid)
                if spec.get("abort_at") is not None:
                    self.aborts.setdefault(int(spec["abort_at"]), []).append(rid)
        for rid in self.aborts.pop(step, []):
            if engine.abort(rid):
                self.log.append(f"step {step}: aborted request {rid}")
        return added

    def _next_turn(self, engine: LLMEngine, c: _Conversation) -> str:
        c.messages.append({"role": "user", "content": c.turns.pop(0)})
        c.request_id = self._add(engine, list(c.messages), c.spec)
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
