"""Demos for the attach and fleet windows with no vLLM at hand: kvscope engines in this process (the embedded
SmolLM2) publishing vLLM's KV events, and the window's source attached to them. What the docs' attach and fleet
pictures show (``python -m kvscope.cli.demo attach|fleet``). No Qt here: a demo is a source, a function that steps
its engines before each poll, and what to close after."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine import EngineConfig, SamplingParams


@dataclass
class Demo:
    source: object  # an AttachedSource or a FleetSource, polls that do not wait
    before_step: Callable[[], None]  # steps the engines that publish (called before each poll)
    decode: Callable | None = None
    tokenize: Callable[[str], list[int]] | None = None
    route: str | None = None  # a fleet demo's prompt in the box
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c()


def _publishing(engine, block_size: int = 16):
    """A ``LiveSource`` over ``engine`` whose events a publisher sends in vLLM's format, and the publisher."""
    from kvscope.runtime.build import KVEventsObserver
    from kvscope.runtime.kv_events_options import KVEventsConfig
    from kvscope.runtime.kv_publisher import KVEventPublisher
    from kvscope.sources.live import LiveSource

    session = LiveSource(engine)
    pub = KVEventPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), block_size
    )
    session.observers.append(KVEventsObserver(pub))
    return session, pub


def attach_demo(blocks: int = 40) -> Demo:
    """One engine (a small pool: evictions) serving chats that share a system prompt and plain prompts that share
    an opening, two at a time; the attach window's source subscribes to its events."""
    from engine import LLMEngine
    from kvscope.presets import shared_system_prompt
    from kvscope.sources.attached import AttachConfig, AttachedSource
    from kvscope.sources.endpoints import connectable

    engine = LLMEngine(EngineConfig(num_gpu_blocks=blocks, block_size=16, max_num_seqs=4))
    session, pub = _publishing(engine)
    source = AttachedSource(
        AttachConfig(connectable(pub.endpoint), connectable(pub.replay_endpoint), block_size=16, poll_interval=0.0)
    )
    params = SamplingParams(max_tokens=24, temperature=0.0)
    topics = ["a hash table", "a B-tree", "virtual memory", "a TCP handshake", "garbage collection", "an LRU cache"]
    count = [0]

    def step() -> None:
        # Two in flight: chats sharing a system prompt, and plain prompts sharing an opening.
        if len(engine.requests) < 2:
            i = count[0]
            session.inject(
                shared_system_prompt(i // 2)
                if i % 2 == 0
                else f"Explain to a first-year student, step by step and with one small example, how "
                f"{topics[(i // 2) % len(topics)]} works.",
                params,
            )
            count[0] += 1
        if session.has_work():
            session.step()

    decode = engine.tokenizer.decode if engine.tokenizer else None
    return Demo(source, step, decode=decode, closers=[session.close, pub.close])


def fleet_demo(blocks: int = 16, steps: int | None = None) -> Demo:
    """Four kvscope engines (one set of SmolLM2 weights, a pool each) publishing vLLM's KV events with vLLM's
    sha256_cbor hashes, watched as a fleet: chats sharing a system prompt sent round robin to a, b and c (so the
    system prompt is cached three times; their pools evict), d serving other prompts until it goes away (25 polls
    before ``steps``, else at poll 120). The prompt box asks where the last chat sent to b would go."""
    from engine import LLMEngine
    from engine.core.vllm_hashing import seed_from_env
    from kvscope.presets import QUESTIONS, SYSTEM_PROMPT
    from kvscope.sources.endpoints import connectable
    from kvscope.sources.fleet import FleetSource
    from kvscope.sources.fleet_spec import FleetSpec, InstanceSpec

    config = EngineConfig(num_gpu_blocks=blocks, block_size=16, max_num_seqs=2, hash_algo="sha256_cbor")
    first = LLMEngine(config)
    engines = [first] + [
        LLMEngine.from_model(first.runner.model, first.tokenizer, config, name=first.model_name) for _ in range(3)
    ]
    sessions, pubs = zip(*(_publishing(e) for e in engines))
    bpb = first.runner.block_bytes
    spec = FleetSpec(
        tuple(
            InstanceSpec(
                name,
                connectable(p.endpoint),
                connectable(p.replay_endpoint),
                bytes_per_block=bpb,
                hash_algo="sha256_cbor",
                hash_seed=seed_from_env(),
            )
            for name, p in zip("abcd", pubs)
        ),
        "demo: four kvscope engines",
    )
    source = FleetSource(spec, poll_interval=0.0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    asked, polls = [0], [0]
    others = [
        "Write a haiku about a disk scheduler.",
        "List three uses of a bloom filter.",
        "Explain a TCP handshake to a child.",
        "Why do B-trees have a high fan-out?",
    ]
    gone_at = steps - 25 if steps else 120

    def chat(i: int) -> str:  # the system prompt, then a question long enough to fill blocks of its own
        return (
            f"{SYSTEM_PROMPT}\n\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]} Please answer for a first-year "
            f"student, with one small example from a real operating system, and say which textbook chapter "
            f"covers it."
        )

    def step() -> None:
        poll = polls[0]
        polls[0] += 1
        i = asked[0]
        if all(len(e.requests) < 2 for e in engines[:3]) and i < 15:
            sessions[i % 3].inject(chat(i), params)
            asked[0] += 1
        if poll < gone_at and not engines[3].requests:
            sessions[3].inject(others[poll % len(others)], params)
        if poll == gone_at:
            sessions[3].observers.clear()
            pubs[3].close()  # d goes away: its subscriber sees the connection drop
        for s in list(sessions[:3]) + ([sessions[3]] if poll < gone_at else []):
            if s.has_work():
                s.step()

    tok = first.tokenizer
    return Demo(
        source,
        step,
        decode=tok.decode,
        tokenize=lambda t: list(tok.encode(t)),
        route=chat(13),
        closers=[s.close for s in sessions] + [p.close for p in pubs],
    )
