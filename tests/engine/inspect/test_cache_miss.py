"""Why a request missed the prefix cache (issue 15): each reason from a constructed case, then the same
from a live engine and in --headless --json."""

from __future__ import annotations

import json

from engine import LLMEngine, SamplingParams
from engine.inspect.cache_miss import CacheMissExplainer
from engine.inspect.events import BlockAllocated, BlockEvicted, BlockFreed, BlockStored, RequestAdmitted
from kvscope.sources.live import LiveSource
from kvscope.sources.summary import Summary

BS = 4
A = (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)  # 3 full blocks + 1 token


def stored(chain, tokens, salt=""):
    """BlockStored events for ``tokens``' full blocks, hashes named by content (and salt)."""
    events, parent = [], None
    for j in range(len(tokens) // BS):
        h = f"{salt}h{tokens[: (j + 1) * BS]}"
        events.append(BlockStored(chain + j, h, "a", tuple(tokens[j * BS : (j + 1) * BS]), parent))
        parent = h
    return events


def explain(prompt, hits, before, decode=None, after=()):
    ex = CacheMissExplainer(BS, decode)
    ex.feed(1, before, {})
    ex.feed(2, [*after, RequestAdmitted("b", len(prompt), hits)], {"b": tuple(prompt)})
    return ex.misses["b"]


def test_nothing_cached_at_the_start():
    m = explain(A, 0, [])
    assert (m.reason, m.block_index, m.token_position) == ("no_cached_block", 0, 0)


def test_a_chain_that_differs_at_a_token_names_the_position():
    prompt = A[:6] + (99,) + A[7:]  # a "timestamp" at position 6
    m = explain(prompt, 4, stored(0, A))
    assert (m.reason, m.block_index, m.token_position) == ("differs_at", 1, 6)


def test_the_prompt_ends_inside_the_block():
    m = explain(A, 12, stored(0, A))
    assert (m.reason, m.block_index, m.token_position) == ("prompt_ends_in_block", 3, 12)
    m = explain(A[:8], 4, stored(0, A))  # a full last block: its last token is computed, never a hit
    assert (m.reason, m.block_index) == ("prompt_ends_in_block", 1)


def test_an_evicted_block_names_its_step():
    events = stored(0, A)
    evict = [BlockEvicted(1, events[1].block_hash), BlockEvicted(2, events[2].block_hash)]
    m = explain(A, 4, events, after=evict)
    assert (m.reason, m.block_index, m.evicted_at) == ("evicted", 1, 2)


def test_the_same_tokens_under_another_salt_are_a_different_identity():
    m = explain(A, 0, stored(0, A, salt="tenant-1:"))
    assert (m.reason, m.block_index) == ("different_identity", 0)


def test_the_same_text_in_other_token_ids_is_a_different_tokenization():
    words = {1: "<", 2: "s>", 100: "<s>"}

    def decode(ids):
        return "".join(words.get(i, chr(65 + i % 26)) for i in ids)

    cached = A[:4] + (100, 20, 21, 22)  # "<s>" as one special token
    prompt = A[:4] + (1, 2, 20, 21, 22, 23)  # the same text in two ordinary tokens
    m = explain(prompt, 4, stored(0, cached), decode=decode)
    assert (m.reason, m.block_index, m.token_position) == ("different_tokenization", 1, 4)
    assert explain(prompt, 4, stored(0, cached)).reason == "differs_at"  # without text, only ids differ


def test_a_block_stored_earlier_in_the_same_step_is_in_the_view_at_admission():
    """The pool publishes at scheduling, so a request admitted later in the step sees (and hits) it."""
    ex = CacheMissExplainer(BS)
    b = A[:6] + (99,) + A[7:]
    ex.feed(1, [BlockAllocated(0, "a"), *stored(0, A), RequestAdmitted("b", len(b), 4)], {"b": b})
    assert (ex.misses["b"].reason, ex.misses["b"].token_position) == ("differs_at", 6)
    ex.feed(2, [BlockFreed(0, "a", 0)], {})


def test_a_withdrawn_block_leaves_the_view_in_the_same_step():
    from engine.inspect.events import BlockUnpublished

    ex = CacheMissExplainer(BS)
    events = stored(0, A)
    withdrawn = [BlockUnpublished(e.block_id, e.block_hash, "step failed") for e in events]
    ex.feed(1, [*events, *withdrawn, RequestAdmitted("b", len(A), 0)], {"b": A})
    assert ex.misses["b"].reason == "no_cached_block"


def test_tokens_put_in_front_of_a_cached_prompt_are_a_shift():
    """A request id before a shared system prompt: the cached chain is there, k tokens later."""
    m = explain((90, 91, 92) + A, 0, stored(0, A))
    assert (m.reason, m.block_index, m.token_position) == ("shifted", 0, 0)
    assert "a prefix of 3 token(s) shifted the rest: the cached chain starts at token 3" in m.detail
    one = explain((90,) + A, 0, stored(0, A))  # the lab's one-token shift
    assert one.reason == "shifted" and "prefix of 1 token(s)" in one.detail


def test_tokens_put_in_after_a_hit_are_a_shift_at_that_token():
    prompt = A[:4] + (90, 91) + A[4:]
    m = explain(prompt, 4, stored(0, A))
    assert (m.reason, m.block_index, m.token_position) == ("shifted", 1, 4)
    assert "2 token(s) put in at token 4" in m.detail and "continues at token 6" in m.detail


def test_a_changed_token_is_not_a_shift():
    m = explain((99,) + A[1:], 0, stored(0, A))
    assert (m.reason, m.token_position) == ("differs_at", 0)


GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_a_live_engine_explains_each_miss(tiny_hf):
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=BS, num_gpu_blocks=10)
    source = LiveSource(engine)
    summary = Summary()
    a = list(range(10, 23))  # 13 tokens: 3 full blocks

    def run(prompt, salt=None):
        rid = engine.add_request(prompt, GREEDY, cache_salt=salt)
        summary.add(source.current())
        while source.has_work():
            summary.add(source.step())
        return rid

    first = run(a)
    stamp = run(a[:6] + [200] + a[7:])
    salted = run(a, salt="tenant-2")
    for start in (40, 80):  # two other prompts fill the 10-block pool and evict a's blocks
        run(list(range(start, start + 20)))
    again = run(a)
    source.close()
    got = {r["request_id"]: r["prefix_cache_miss"] for r in summary.as_dict()["requests"]}
    assert got[first]["reason"] == "no_cached_block"
    assert (got[stamp]["reason"], got[stamp]["token_position"]) == ("differs_at", 6)
    assert got[salted]["reason"] == "different_identity"
    assert got[again]["reason"] == "evicted" and got[again]["evicted_at"] is not None


def test_headless_json_carries_the_miss_of_every_request(capsys, tiny_dir):
    from kvscope.cli import main

    code = main(
        [
            "--model",
            tiny_dir,
            "--headless",
            "--json",
            "--num-gpu-blocks",
            "32",
            "--block-size",
            "4",
            "--inject-ids",
            "1,2,3,4,5,6,7,8,9",
            "--max-tokens",
            "2",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = out["requests"]
    assert r["prefix_cache_miss"]["reason"] == "no_cached_block" and r["prefix_cache_miss"]["block_index"] == 0


def test_plain_headless_prints_the_hit_rate_and_each_first_miss(capsys, tiny_dir):
    """Without --json the text says the hit rate and why each request missed, from the same summary."""
    from kvscope.cli import main

    shared = "1,2,3,4,5,6,7,8,9"
    code = main(
        [
            "--model",
            tiny_dir,
            "--headless",
            "--num-gpu-blocks",
            "32",
            "--block-size",
            "4",
            "--inject-ids",
            shared,
            "--inject-ids",
            "1,2,3,4,50,51,52,53,54",
            "--max-tokens",
            "2",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    # admitted in the same step, the second hits the first's block 0 (published as it was scheduled)
    assert "first miss: no_cached_block: nothing cached continues the prompt at the start" in text
    assert "(4 cached)" in text and "first miss: differs_at: a cached chain differs from the prompt at token 4" in text
    line = next(ln for ln in text.splitlines() if "hit rate" in ln)
    assert line.endswith("first misses: 1 no_cached_block, 1 differs_at") or line.endswith(
        "first misses: 1 differs_at, 1 no_cached_block"
    )
    hits, queries = map(int, line.split("(")[1].split(" ")[0].split("/"))
    assert queries == 18 and line.split("hit rate ")[1].startswith(f"{100 * hits / queries:.0f}%")


def test_text_put_in_front_that_changes_the_seam_is_a_shift_found_on_a_later_block():
    """Issue 34: "session 8812-alpha. You are..." before a cached "You are...": BPE turns "You" into " You" at
    the seam, so the chain's first block never reappears; its second does, 5 tokens later. Hand-made ids
    reproduce the embedded tokenizer's seam (test below with the real one)."""
    you, space_you = 2683, 1206
    cached = (you,) + A[1:]
    prompt = (90, 91, 92, 93, space_you) + A[1:]  # four tokens of session id, then the changed seam token
    m = explain(prompt, 0, stored(0, cached))
    assert (m.reason, m.block_index, m.token_position, m.shift, m.seam) == ("shifted", 0, 0, 4, 5)
    assert "reappears 4 token(s) later from token 5" in m.detail and "seam changed" in m.detail
    assert "the token before it is [1206] in the prompt, [2683] in the cache" in m.detail  # the seam's tokens
    assert m.to_dict()["shift"] == 4 and m.to_dict()["seam"] == 5
    # without the shift the same change is a token that differs, not a shift
    assert explain((space_you,) + A[1:], 0, stored(0, cached)).reason == "differs_at"


def test_a_shift_after_a_hit_is_found_on_a_later_block_with_its_seam():
    cached = A + (18, 19, 20)  # 4 full blocks
    prompt = A[:4] + (90, 91, 77) + A[5:] + (18, 19, 20)  # token 4 changed at the seam, 2 put in before it
    m = explain(prompt, 4, stored(0, cached))
    assert (m.reason, m.block_index, m.token_position, m.shift, m.seam) == ("shifted", 1, 4, 2, 7)


def test_the_embedded_tokenizers_seam_is_named():
    from engine.runner.models.loader import embedded_folder, load_tokenizer

    tok = load_tokenizer(str(embedded_folder()))
    system = (
        "You are a helpful assistant who explains operating systems to students, briefly and clearly, "
        "with one example each time and no more than three sentences. When a student asks about memory, "
        "draw the page table first, then the physical frames, and say which entries are shared."
    )
    cached = tuple(tok.encode(system))
    prompt = tuple(tok.encode("session 8812-alpha. " + system))
    assert prompt[-len(cached) + 1 :] == cached[1:] and prompt[-len(cached)] != cached[0]  # the seam changed
    ex = CacheMissExplainer(16, lambda ids: tok.decode(ids))
    parent, events = None, []
    for j in range(len(cached) // 16):
        h = f"h{j}"
        events.append(BlockStored(j, h, "a", cached[j * 16 : (j + 1) * 16], parent))
        parent = h
    ex.feed(1, events, {})
    ex.feed(2, [RequestAdmitted("b", len(prompt), 0)], {"b": prompt})
    m = ex.misses["b"]
    k = len(prompt) - len(cached)
    assert len(cached) >= 48  # three full blocks: the second is where the chain reappears
    assert (m.reason, m.shift, m.seam) == ("shifted", k, k + 1)
    assert "You" in m.detail and "alpha." in m.detail
