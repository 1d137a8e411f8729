"""The vLLM connector's scheduler-side plan: which blocks are looked up, loaded and saved."""

from mooncake_ray.integrations._vllm_plan import SchedulerPlan
from mooncake_ray.kv import page_hashes

BS = 4


def stored(n):
    """A store holding the first ``n`` blocks of whatever is asked."""
    return lambda hashes: min(n, len(hashes))


def test_match_counts_leading_stored_blocks_but_never_the_last_tokens_block():
    p = SchedulerPlan(BS)
    tokens = list(range(17))  # 4 full blocks + 1 token; the block holding token 16 is never matched
    assert p.match("a", tokens, 0, stored(10)) == 16
    tokens = list(range(16))  # exactly 4 blocks: the last holds the last token, so 3 at most
    assert p.match("b", tokens, 0, stored(10)) == 12
    assert p.match("c", list(range(17)), 0, stored(2)) == 8
    assert p.match("d", list(range(17)), 8, stored(10)) == 8  # vLLM had 2 blocks itself: 2 more
    assert p.match("e", list(range(3)), 0, stored(10)) == 0
    assert p.match("f", list(range(17)), 0, stored(0)) == 0


def test_hashes_are_the_kv_layers_chained_hashes_extended_incrementally():
    p = SchedulerPlan(BS)
    tokens = list(range(40))
    assert p.hashes("r", tokens[:9], 2) == page_hashes(tokens[:8], BS)
    assert p.hashes("r", tokens, 10) == page_hashes(tokens, BS)


def test_allocated_blocks_become_one_load_in_the_next_step():
    p = SchedulerPlan(BS)
    tokens = list(range(21))
    p.match("r", tokens, 4, stored(3))  # blocks 1..3 in the store
    p.allocated("r", [70, 71, 72, 73, 74, 75], 12)
    plan = p.step([], lambda r: [])
    assert [(x.req_id, x.first, x.block_ids) for x in plan.loads] == [("r", 1, [71, 72, 73])]
    assert plan.loads[0].hashes == page_hashes(tokens, BS)[1:4]
    assert p.step([], lambda r: []).loads == []  # sent once


def test_saves_skip_loaded_and_local_blocks_and_follow_the_steps():
    p = SchedulerPlan(BS)
    tokens = list(range(30))
    ids = list(range(100, 108))
    p.match("r", tokens[:22], 4, stored(2))  # vLLM has block 0, the store blocks 1-2
    p.allocated("r", ids, 8)
    # step 1: prefill computes tokens 12..19 (blocks 3 and 4 complete)
    plan = p.step([("r", tokens[:22], 22, 12, 8)], lambda r: ids)
    assert [(s.first, s.block_ids) for s in plan.saves] == [(3, [103, 104])]
    # step 2: tokens 20, 21 (block 5 not full yet)
    assert p.step([("r", tokens[:22], 22, 20, 2)], lambda r: ids).saves == []
    # decode steps fill block 5 with generated tokens 22, 23
    plan = p.step([("r", tokens[:24], 22, 22, 1)], lambda r: ids)
    assert plan.saves == []
    plan = p.step([("r", tokens[:24], 22, 23, 1)], lambda r: ids)
    assert [(s.first, s.block_ids, s.hashes) for s in plan.saves] == [(5, [105], page_hashes(tokens[:24], BS)[5:])]
    assert plan.saves[0].parent == page_hashes(tokens[:24], BS)[4]  # the block before the run
    assert plan.saves[0].keep is None


def test_a_conversation_hint_marks_every_save_of_its_request():
    p = SchedulerPlan(BS)
    tokens = list(range(24))
    p.match("r", tokens, 0, stored(0))
    p.keep("r", "conv-1", 60.0)
    plan = p.step([("r", tokens, 24, 0, 24)], lambda r: list(range(10)))
    assert [(s.first, s.parent, s.keep) for s in plan.saves] == [(0, "", ("conv-1", 60.0))]


def test_a_prefill_for_a_remote_decode_holds_its_prompt_until_the_decodes_load_releases_it():
    """Every save of a producer's request for a remote decode holds its blocks (a chunked
    prefill: each chunk); the consumer's load of a prefill's blocks releases them, once."""
    tokens = list(range(26))  # a prompt of 26: 6 full blocks
    p = SchedulerPlan(BS, save_decode=False, sync_saves=True)
    p.match("r", tokens, 0, stored(0))
    p.hold("r", 30.0)
    ids = lambda r: list(range(7))  # noqa: E731
    first = p.step([("r", tokens, 26, 0, 16)], ids).saves  # chunk 1: blocks 0-3
    last = p.step([("r", tokens, 26, 16, 10)], ids).saves  # chunk 2: blocks 4, 5
    assert [(s.first, len(s.hashes), s.hold_s) for s in first + last] == [(0, 4, 30.0), (4, 2, 30.0)]
    found = SchedulerPlan(BS, save_decode=False, sync_saves=True)  # blocks 0-2 in the store: held too
    assert found.match("f", tokens, 0, stored(3)) == 12
    found.hold("f", 30.0)
    runs = found.step([("f", tokens, 26, 12, 14)], ids).saves
    assert [(s.first, len(s.hashes), s.parent, s.hold_s) for s in runs] == [(0, 6, "", 30.0)]
    assert found.step([("f", tokens, 26, 26, 1)], ids).saves == []  # once
    cached = SchedulerPlan(BS, save_decode=False, sync_saves=True)  # all but the last block found
    cached.match("c", tokens, 0, stored(6))
    cached.hold("c", 30.0)
    assert [(s.first, len(s.hashes)) for s in cached.step([("c", tokens, 26, 24, 2)], ids).saves] == [(0, 6)]
    short = SchedulerPlan(BS, save_decode=False, sync_saves=True)  # a first chunk shorter than the hit
    short.match("s", tokens, 0, stored(5))
    short.hold("s", 30.0)
    assert [(s.first, len(s.hashes)) for s in short.step([("s", tokens, 26, 0, 8)], ids).saves] == [(0, 5)]
    assert [(s.first, len(s.hashes)) for s in short.step([("s", tokens, 26, 8, 18)], ids).saves] == [(5, 1)]
    other = SchedulerPlan(BS, save_decode=False, sync_saves=True)  # no remote decode: nothing held
    other.match("o", tokens, 0, stored(0))
    assert [s.hold_s for s in other.step([("o", tokens, 26, 0, 26)], ids).saves] == [None]

    c = SchedulerPlan(BS, save=False)
    prompt = tokens + [99]  # the decode request: the prompt and the first token
    c.release_source("d", prompt, 24)  # the producer's stored_tokens
    assert c.match("d", prompt, 4, stored(10)) == 20  # vLLM had block 0; the last block it computes
    c.allocated("d", list(range(7)), 20)
    loads = c.step([], lambda r: []).loads
    assert [(x.first, len(x.hashes)) for x in loads] == [(1, 5)]
    assert loads[0].release == page_hashes(tokens, BS)  # every block the prefill held, all 6
    c.match("d", prompt, 4, stored(10))
    c.allocated("d", list(range(7)), 20)
    assert c.step([], lambda r: []).loads[0].release == []  # released once
    for bad in (None, "24", 2, 10 ** 6):  # no producer's figure, or not blocks of this prompt
        c.release_source("x", prompt, bad)
        c.match("x", prompt, 0, stored(10))
        c.allocated("x", list(range(7)), 24)
        assert c.step([], lambda r: []).loads[0].release == [], bad


def test_save_decode_off_stops_at_the_prompt_and_a_consumer_never_saves():
    p = SchedulerPlan(BS, save_decode=False)
    tokens = list(range(16))
    plan = p.step([("r", tokens, 10, 0, 16)], lambda r: list(range(4)))
    assert [(s.first, s.block_ids) for s in plan.saves] == [(0, [0, 1])]  # prompt of 10: 2 full blocks
    c = SchedulerPlan(BS, save=False)
    assert c.step([("r", tokens, 16, 0, 16)], lambda r: list(range(4))).saves == []


def test_finished_holds_blocks_only_for_asynchronous_saves():
    p = SchedulerPlan(BS)
    p.step([("saved", list(range(8)), 8, 0, 8)], lambda r: [0, 1])
    p.step([("short", list(range(3)), 3, 0, 3)], lambda r: [2])
    assert p.finished("saved") is True
    assert p.finished("short") is False  # nothing was saved for it
    assert p.finished("unknown") is False
    s = SchedulerPlan(BS, sync_saves=True)
    s.step([("r", list(range(8)), 8, 0, 8)], lambda r: [0, 1])
    assert s.finished("r") is False  # its saves ended inside their step
    assert len(p) == 0 and len(s) == 0


def test_preemption_asks_the_worker_to_drain_saves():
    p = SchedulerPlan(BS)
    assert p.step([], lambda r: [], preempted=True).drain_saves is True
    assert p.step([], lambda r: []).drain_saves is False
