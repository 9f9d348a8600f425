"""Routing policies and the worker registry's state rules, without any network."""

from __future__ import annotations

import math
import random
from array import array

import pytest

from rlfleet.errors import InvalidInput, NotFound
from rlfleet_router.openai_routing import routing_body
from rlfleet_router.policies import (
    GROUP_SIZE_WINDOW,
    MAX_SLACK_GROUPS,
    CacheAware,
    Choice,
    LeastLoad,
    PolicyOptions,
    PowerOfTwo,
    RoundRobin,
    RoutingRequest,
    available_policies,
    create_policy,
)
from rlfleet_router.workers import Worker, WorkerRegistry, WorkerState, normalize_worker_url

REQUEST = RoutingRequest(route="/generate", body={"text": "1+1="})


def make_workers(*in_flight: int) -> list[Worker]:
    return [Worker(url=f"http://127.0.0.1:{9000 + i}", in_flight=n) for i, n in enumerate(in_flight)]


def test_least_load_picks_fewest_in_flight() -> None:
    workers = make_workers(3, 1, 2)
    assert LeastLoad().select(workers, REQUEST).worker is workers[1]


def test_least_load_rotates_among_ties() -> None:
    workers = make_workers(0, 5, 0)
    policy = LeastLoad()
    picks = [policy.select(workers, REQUEST).worker for _ in range(4)]
    assert picks == [workers[0], workers[2], workers[0], workers[2]]


def test_least_load_follows_load_as_it_changes() -> None:
    workers = make_workers(0, 0)
    policy = LeastLoad()
    for _ in range(6):
        policy.select(workers, REQUEST).worker.in_flight += 1
    assert [w.in_flight for w in workers] == [3, 3]


def test_round_robin_cycles_regardless_of_load() -> None:
    workers = make_workers(10, 0, 0)
    policy = RoundRobin()
    picks = [policy.select(workers, REQUEST).worker for _ in range(4)]
    assert picks == [workers[0], workers[1], workers[2], workers[0]]


def test_power_of_two_never_picks_the_busier_of_its_pair() -> None:
    workers = make_workers(9, 0)
    policy = PowerOfTwo(PolicyOptions(seed=1))
    assert {policy.select(workers, REQUEST).worker.url for _ in range(5)} == {workers[1].url}


def generate(prompt: list[int], max_new_tokens: int = 8) -> RoutingRequest:
    return RoutingRequest("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})


def test_cache_aware_weighs_uncached_tokens_against_requests_in_flight() -> None:
    workers = make_workers(0, 0, 0)
    # A 40-token family prefix is worth 4 requests in flight.
    policy = CacheAware(PolicyOptions(cache_threshold=0.5, cache_tokens_per_request=10, balance_rel_threshold=100))
    family = list(range(100, 140))
    first = policy.select(workers, generate([*family, 1]))
    assert first.reason == "low_match"

    first.worker.in_flight = 3  # 3 + 1 token to prefill beats 0 + 41 tokens elsewhere
    stays = policy.select(workers, generate([*family, 2]))
    assert stays.worker is first.worker and stays.reason == "cache_hit"

    first.worker.in_flight = 5  # now the prefix is worth less than the load
    spill = policy.select(workers, generate([*family, 3]))
    assert spill.worker is not first.worker and spill.reason == "imbalance"
    # The tree now knows both engines hold the family; the less loaded of them gets the next one.
    spill.worker.in_flight = 1
    again = policy.select(workers, generate([*family, 4]))
    assert again.worker is spill.worker and again.reason == "cache_hit"

    other = policy.select(workers, generate(list(range(500, 540))))
    assert other.reason == "low_match" and other.worker.in_flight == 0


def route_group(policy: CacheAware, workers: list[Worker], prompt: list[int], samples: int = 8) -> list[Worker]:
    """Routes the samples of one prompt one after another, each staying in flight; returns where each went."""
    picks = []
    for _ in range(samples):
        choice = policy.select(workers, generate(prompt))
        choice.worker.in_flight += 1
        picks.append(choice.worker)
    return picks


def test_cache_aware_learns_the_group_size_and_places_a_group_as_one_unit() -> None:
    workers = make_workers(0, 0, 0, 0)
    policy = CacheAware(PolicyOptions(cache_threshold=0.3, cache_tokens_per_request=40))
    assert policy.group_size == 1
    warmup = list(range(5000, 5400))
    for question in range(10):  # groups of 8 that finish before the next one starts
        route_group(policy, workers, [*warmup, question])
        for worker in workers:
            worker.in_flight = 0
    assert policy.group_size == 8

    family = list(range(1000, 1400))  # a 400-token prefix shared by the next prompts, then a question
    picks = route_group(policy, workers, [*family, 1])
    assert picks == [picks[0]] * 8, "a group's samples stay together"
    home = picks[0]
    assert policy.tree.match((*family, 2)).matched == {home.id: len(family)}

    # The family's engine runs one group (8 in flight): a second one fits within the balance bound, 10 + 2 x the
    # fleet's mean in flight with the group counted in, the engine's own requests weighing 2 / 4 each
    # (10 + 2 x 8 / 4 + 0.5 x 8 = 18 >= 8 + 8), and costs no prefill of the family there.
    home.in_flight = 8
    assert route_group(policy, workers, [*family, 50]) == [home] * 8
    # With two groups (16 in flight) a third would not fit (10 + 2 x 8 / 4 + 0.5 x 16 = 22 < 24): the next group
    # goes whole to an idle engine.
    picks = route_group(policy, workers, [*family, 100])
    assert picks == [picks[0]] * 8 and picks[0] is not home
    assert policy.tree.match((*family, 100)).matched == {picks[0].id: len(family) + 1, home.id: len(family)}


def test_cache_aware_splits_a_group_only_when_its_engine_is_overloaded() -> None:
    workers = make_workers(0, 0, 0)
    policy = CacheAware(PolicyOptions(balance_abs_threshold=2, balance_rel_threshold=1.25))
    for question in range(8):  # groups of 4, each finished before the next
        route_group(policy, workers, [*range(300, 340), question], samples=4)
        for worker in workers:
            worker.in_flight = 0
    assert policy.group_size == 4
    picks = route_group(policy, workers, list(range(200, 240)), samples=16)  # a far larger group
    first = picks[0]
    # Its samples stay while the engine has fewer than 2 + 1.25 x the mean in flight + the group size
    # (about 4, and growing as this group is counted), then spill to an engine that is not overloaded.
    moved = next(k for k, worker in enumerate(picks) if worker is not first)
    assert 8 <= moved <= 12
    assert first.in_flight == moved and picks[moved:] == [picks[moved]] * (16 - moved)


def test_cache_aware_spreads_a_family_once_its_engine_has_served_its_share() -> None:
    workers = make_workers(0, 0, 0, 0)
    policy = CacheAware()
    family = list(range(1000, 1400))  # one family's questions, each finished before the next is sent
    choices = [policy.select(workers, generate([*family, question])) for question in range(200)]
    served = [sum(c.worker is w for c in choices) for w in workers]
    # No engine is ever busy, yet none keeps the whole family: each takes new prompts only while its share
    # of the last ~100 requests stays within 1.15 x the mean + 1 ...
    assert max(served) <= 1.15 * 50 + 2, served
    # ... and the family is prefilled once per engine: after the first one, only the three spreads missed.
    assert [c.reason for c in choices].count("cache_hit") == 200 - 4
    assert policy.tree.match((*family, 999)).matched == {w.id: len(family) for w in workers}


@pytest.mark.parametrize(
    ("engines", "samples", "rel"), [(2, 1, 2.0), (2, 8, 2.0), (4, 1, 2.0), (4, 8, 2.0), (2, 8, 4.0), (4, 8, 8.0)]
)
def test_cache_aware_sends_no_new_prompt_to_an_engine_whose_requests_never_end(
    engines: int, samples: int, rel: float
) -> None:
    workers = make_workers(*[0] * engines)
    hung = workers[0]
    policy = CacheAware(PolicyOptions(balance_rel_threshold=rel))
    sent: list[int] = []  # the questions a sample of went to the hung engine
    for question in range(100):  # five families; the healthy engines answer at once, the hung one never does
        family = range(1000 * (question % 5), 1000 * (question % 5) + 300)
        for _ in range(samples):
            choice = policy.select(workers, generate([*family, question]))
            if choice.worker is hung:
                hung.in_flight += 1
                sent.append(question)
    # Once its requests in flight leave no room for a group, it takes none: the others' share of the traffic
    # (all of it) does not send new prompts back to it. It had half of them (48 of 100 on 2 engines). Its own
    # requests raise its bound by at most 0.625 each, so it fills up even where rel x its part of the mean would
    # grow as fast as they do (rel >= the engines).
    assert not [q for q in sent if q >= 50], sent
    if rel == PolicyOptions().balance_rel_threshold:
        assert len(sent) <= 4 * samples, sent


def test_cache_aware_keeps_a_conversation_where_its_history_is() -> None:
    workers = make_workers(0, 0)
    home_engine, other = workers
    policy = CacheAware()
    system = list(range(2000, 2300))
    turn = [*system, 1, 1]  # the system prompt and a first message
    assert policy.select(workers, generate(turn)).worker is home_engine
    home_engine.in_flight = 5
    # The next turn (the previous prompt, the answer and a new message) follows the history although the
    # engine has no room for a new prompt (5 + 1 > 1.25 + 1.25 x 6 / 2): the conversation was placed already.
    turn = [*turn, 50, 51, 2, 2]
    assert policy.select(workers, generate(turn)) == Choice(home_engine, "cache_hit")
    # A new conversation on the same system prompt is a new prompt: it goes where there is room.
    assert policy.select(workers, generate([*system, 3, 3])).worker is other
    # An overloaded engine (8 in flight, the bound being 1.25 + 1.25 x 8 / 2 + 1) lets the conversation move.
    home_engine.in_flight = 8
    moved = policy.select(workers, generate([*turn, 60, 61, 4, 4]))
    assert moved == Choice(other, "imbalance")
    # From there on, it continues where it went last.
    home_engine.in_flight = 0
    assert policy.select(workers, generate([*turn, 60, 61, 4, 4, 70, 5])).worker is other


def converse(policy: CacheAware, workers: list[Worker], system: list[int], conversation: int) -> Worker:
    """Four turns of one conversation on `system`, each answered before the next; the engine of its first."""
    turn = [*system, conversation, conversation]
    first = policy.select(workers, generate(turn)).worker
    for answer in range(3):
        turn = [*turn, 50 + answer, 60 + answer, conversation]
        assert policy.select(workers, generate(turn)).worker is first, "a conversation stays where its history is"
    return first


@pytest.mark.parametrize("slack", [2.0, 1000.0])
def test_cache_aware_places_no_more_conversations_on_an_engine_than_the_mean_plus_the_slack(slack: float) -> None:
    workers = make_workers(0, 0)
    # The share of recent requests out of the way: with nothing in flight, only the placement bound spreads
    # conversations that all start with one system prompt, which makes the engines holding it the cheapest.
    policy = CacheAware(PolicyOptions(balance_share_threshold=100, balance_placement_slack=slack))
    system = list(range(5000, 5300))
    homes = [converse(policy, workers, system, conversation) for conversation in range(20)]
    if slack > 20:
        assert homes == [workers[0]] * 20
        return
    # Counted in conversations, not requests (4 each): at every point no engine is more than 2 above the mean.
    for placed in range(1, 21):
        assert all(homes[:placed].count(w) <= placed / 2 + slack for w in workers), homes
    assert homes[:5] == [workers[0]] * 4 + [workers[1]], "4 + 1 <= (4 + 1) / 2 + 2 does not hold"


def test_cache_aware_counts_placements_since_the_fleet_s_caches_were_last_emptied() -> None:
    workers = make_workers(0, 0)
    home, other = workers
    policy = CacheAware(PolicyOptions(balance_share_threshold=100))
    system = list(range(6000, 6300))
    assert [converse(policy, workers, system, c) for c in range(5)] == [home] * 4 + [other]

    def placed() -> list[float]:
        return [policy._placed.score(w.id) for w in workers]

    assert placed() == [4, 1]
    policy.forget_caches([home])  # one engine emptied (a restart): what each took on this step still counts
    assert placed() == [4, 1]
    policy.forget_caches(workers)  # the whole fleet emptied (a weight update): a new step
    assert placed() == [0, 0]
    assert len({converse(policy, workers, system, c).id for c in range(5, 9)}) == 1
    # An engine out of routing (failing its health checks) is not waited for: the healthy ones' update is a step.
    converse(policy, [home], system, 9)
    policy.forget_caches([home])
    assert placed() == [0, 0]


def test_cache_aware_a_retry_on_the_engines_left_is_not_the_fleet_a_step_ends_with() -> None:
    """A retry offered only the engines its request did not fail at names the others (`excluded`): emptying the
    engines it was offered is not a new step while the others are still in routing."""
    workers = make_workers(0, 0, 0)
    first, second, third = workers
    policy = CacheAware(PolicyOptions(balance_share_threshold=100))
    for question in range(3):
        policy.select(workers, generate([7000 + question] * 50))
    placed = [policy._placed.score(w.id) for w in workers]
    assert sum(placed) == 3
    retry = RoutingRequest("/generate", {"input_ids": [7100] * 50}, excluded=frozenset({first.id, second.id}))
    assert policy.select([third], retry).worker is third
    policy.forget_caches([third])  # the engine the retry went to restarted
    assert [policy._placed.score(w.id) for w in workers] == [placed[0], placed[1], placed[2] + 1]
    policy.forget_caches(workers)
    assert [policy._placed.score(w.id) for w in workers] == [0, 0, 0]


@pytest.mark.parametrize(("slack", "rel"), [(10, 1.25), (2, 1.5), (10, 3.0)])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("engines", [2, 3, 4])
def test_cache_aware_follows_a_group_to_the_engine_that_had_room_for_it(
    slack: int, rel: float, group: int, engines: int
) -> None:
    """The follow bound counts a group's own requests once: at the engine (in flight) against the group's room in
    the bound (+ G). An engine that had room for the whole group when it was placed (in flight + G within the
    placement bound, or idle) takes each of the group's later requests while the rest of the fleet is as it was,
    however loaded the fleet is. (Counted twice, in flight + G against the bound, a large group placed on an idle
    engine would be split before its last requests.)"""
    draw = random.Random(group * 10 + engines)
    options = PolicyOptions(
        balance_abs_threshold=slack,
        balance_rel_threshold=rel,
        balance_share_threshold=100,
        balance_placement_slack=1000,
    )
    for case in range(20):
        workers = make_workers(*([0] * engines))
        policy = CacheAware(options)
        for warm in range(GROUP_SIZE_WINDOW // group + 1):  # the group size estimate settles at `group`
            for _ in range(group):
                policy.select(workers, generate([10_000 + warm] * 64))
        assert policy.group_size == group
        for worker in workers:  # an idle fleet first, then loads from light to heavy
            worker.in_flight = draw.randrange(0, 1 + case * 4)
        total = sum(w.in_flight for w in workers)
        room = max(min(slack, MAX_SLACK_GROUPS * group) + rel * (total + group) / engines, group)
        prompt = [20_000 + case] * 64
        home = policy.select(workers, generate(prompt)).worker
        if home.in_flight + group > room:
            continue  # no engine had room for the group: it may be split, as the docstring says
        for sample in range(1, group):
            home.in_flight += 1  # the group's earlier requests are in flight there
            choice = policy.select(workers, generate(prompt))
            assert (choice.worker, choice.reason) == (home, "cache_hit"), (case, sample, [w.in_flight for w in workers])


def test_cache_aware_gives_prompts_of_one_request_a_slack_of_one_group() -> None:
    workers = make_workers(0, 0, 0, 0)
    policy = CacheAware()
    family = list(range(3000, 3400))  # a long prefix that every prompt shares, as a system prompt is
    for question in range(12):
        policy.select(workers, generate([*family, question])).worker.in_flight += 1
    # With groups of one request the slack is 1.25, not balance_abs_threshold (10): the family's engine does
    # not take ten new conversations while the others idle. The prefix costs an engine without it as much as
    # 10 requests in flight, so the fourth engine is not needed yet.
    assert [w.in_flight for w in workers] == [4, 4, 4, 0]


def test_cache_aware_fills_an_idle_fleet_evenly() -> None:
    workers = make_workers(0, 0, 0, 0)
    policy = CacheAware()
    # Prompts nobody holds, each finished before the next: every engine is equally loaded, so each pick
    # goes to the engine that had the least traffic lately rather than to the first one listed.
    picks = [policy.select(workers, generate([k] * 20)).worker for k in range(8)]
    assert picks[:4] == workers and picks[4:] == workers


def test_cache_aware_ignores_a_short_prefix_every_prompt_shares() -> None:
    workers = make_workers(0, 0, 0)
    policy = CacheAware()
    header = [7, 7, 7, 7]  # a chat template's header: below the cache threshold of any prompt here
    picks = [policy.select(workers, generate([*header, *range(100 * k, 100 * k + 36)])).worker for k in range(6)]
    # The engines that served a prompt hold the header; an engine that did not is not dearer for it.
    assert picks[:3] == workers and picks[3:] == workers


def test_cache_aware_prices_text_prompts_in_estimated_tokens() -> None:
    workers = make_workers(0, 0)
    policy = CacheAware(PolicyOptions(cache_tokens_per_request=10, balance_rel_threshold=100))
    family = "x" * 200  # 200 characters: about 50 tokens, worth 5 requests in flight

    def ask(question: str) -> RoutingRequest:
        return RoutingRequest("/generate", {"text": family + question})

    home = policy.select(workers, ask("a")).worker
    home.in_flight = 4
    assert policy.select(workers, ask("b")).worker is home
    home.in_flight = 6
    assert policy.select(workers, ask("c")).worker is not home


def test_cache_aware_routes_text_prompts_and_counts_tokens() -> None:
    workers = make_workers(0, 0)
    policy = CacheAware()
    text = {"text": "You are a careful solver. " * 4 + "12+7=", "sampling_params": {"max_new_tokens": 6, "n": 2}}
    picks = {policy.select(workers, RoutingRequest("/generate", text)).worker.url for _ in range(3)}
    assert len(picks) == 1
    request = RoutingRequest("/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 4}})
    assert request.prompt_key == array("i", [1, 2, 3]) and request.tokens == (3 + 4) * 2
    assert RoutingRequest("/generate", text).tokens == (math.ceil(len(text["text"]) / 4) + 6) * 2
    policy.forget(workers[0])
    policy.forget(workers[1])
    assert policy.tree.tokens == 0


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**70, 2.5])
def test_cache_aware_routes_ids_beyond_32_bits_by_load_and_keeps_them_out_of_its_tree(bad: object) -> None:
    workers = make_workers(2, 0)
    policy = CacheAware()
    malformed = generate([7, 8, bad])  # type: ignore[list-item]
    assert malformed.prompt_key is None and malformed.tokens == 8, "no key; the budget still counts"
    assert policy.select(workers, malformed) == Choice(workers[1], "no_prompt")
    assert policy.tree.tokens == 0
    assert policy.select(workers, generate([7, 8, 9])).reason == "low_match"
    assert policy.tree.tokens == 3 and policy.select(workers, generate([7, 8, 9])).reason == "cache_hit"


def test_registry_by_name_and_unknown_name_lists_known_ones() -> None:
    assert {"cache_aware", "least_load", "power_of_two", "round_robin"} <= set(available_policies())
    assert isinstance(create_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="known policies: cache_aware, least_load, power_of_two, round_robin"):
        create_policy("cache_awarre")


def test_new_worker_is_admitted_after_one_success_a_returning_one_after_threshold() -> None:
    registry = WorkerRegistry(failure_threshold=2, success_threshold=3)
    worker, created = registry.add("http://127.0.0.1:9000/")
    assert created and worker.url == "http://127.0.0.1:9000" and worker.state is WorkerState.PENDING
    registry.record_success(worker)
    assert registry.ready_to_admit(worker)
    registry.admit(worker)
    assert registry.healthy() == [worker]

    registry.record_failure(worker, "boom")
    assert worker.healthy, "one failure is below the threshold"
    registry.record_failure(worker, "boom")
    assert worker.state is WorkerState.UNHEALTHY and registry.healthy() == []

    registry.record_success(worker)
    registry.record_success(worker)
    assert not registry.ready_to_admit(worker)
    registry.record_success(worker)
    assert registry.ready_to_admit(worker)


def test_registry_finds_by_id_or_url_and_keeps_one_entry_per_url() -> None:
    registry = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = registry.add("http://127.0.0.1:9000")
    again, created = registry.add("http://127.0.0.1:9000/")
    assert again is worker and not created
    assert registry.get(worker.id) is worker
    assert registry.get("http://127.0.0.1:9000") is worker
    assert registry.remove("http://127.0.0.1:9000/") is worker
    with pytest.raises(NotFound):
        registry.get(worker.id)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "127.0.0.1:9000",
        "ftp://host:1",
        "http://",
        "http://host:99999",
        "http://host:1/generate",
        "http://h:1?x=1",
        "http://user:secret@h:1",
        # Hosts no engine can have: httpx refused each when a fan-out came to it (a 500 for the whole fleet).
        "http://10.0.0.256:30001",
        "http://1.2.3.4.5:30001",
        "http://exa mple:30001",
        "http://a<b>:30001",
        "http://a..b:30001",
        "http://%41:30001",
        "http://-engine:30001",
        "http://" + "x" * 64 + ":30001",
    ],
)
def test_bad_worker_urls_are_rejected(url: str) -> None:
    with pytest.raises(InvalidInput, match="url"):
        normalize_worker_url(url)


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("HTTP://127.0.0.1:9000/", "http://127.0.0.1:9000"),
        ("http://Engine-0.Engines.rl.svc:30000", "http://engine-0.engines.rl.svc:30000"),
        ("http://engine:80", "http://engine"),
        ("https://engine:443/", "https://engine"),
        ("http://[FD00::7]:30000", "http://[fd00::7]:30000"),
        ("http://rlfleet_engine_1:30000", "http://rlfleet_engine_1:30000"),  # a compose container name
        ("http://engine.:30000", "http://engine.:30000"),
    ],
)
def test_one_engine_has_one_url_however_it_is_spelled(url: str, normal: str) -> None:
    assert normalize_worker_url(url) == normal
    registry = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = registry.add(normal)
    assert registry.add(url) == (worker, False)


def test_cache_aware_forgets_what_an_emptied_engine_held_and_keeps_its_share_of_the_traffic() -> None:
    workers = make_workers(0, 0)
    policy = CacheAware()
    for question in range(4):
        policy.select(workers, generate([*range(100, 400), question]))
    holder = next(w for w in workers if policy.tree.match((*range(100, 400), 9)).matched.get(w.id))
    share = policy._recent_score(holder)
    policy.forget_caches([holder])
    assert holder.id not in policy.tree.match((*range(100, 400), 9)).matched
    assert policy._recent_score(holder) == share, "a flush empties the cache, not the engine's recent traffic"


def test_an_openai_request_without_a_budget_counts_the_routes_default() -> None:
    """/v1/completions generates 16 tokens without max_tokens; it was counted as /generate's 128."""
    prompt = {"prompt": [1, 2, 3]}
    assert RoutingRequest("/v1/completions", routing_body("/v1/completions", prompt)).tokens == 3 + 16
    sized = {**prompt, "max_tokens": 40}
    assert RoutingRequest("/v1/completions", routing_body("/v1/completions", sized)).tokens == 3 + 40


def test_cache_aware_with_a_threshold_of_0_routes_and_follows_only_engines_holding_the_prompt() -> None:
    """--cache-threshold 0 is valid: every engine passed its floor, and one holding nothing failed the request (500,
    KeyError)."""
    workers = make_workers(0, 0)
    policy = CacheAware(PolicyOptions(cache_threshold=0.0))
    first = policy.select(workers, generate([1, 2, 3, 4])).worker
    again = policy.select(workers, generate([1, 2, 3, 4, 5]))
    assert again.worker is first and again.reason == "cache_hit"


def test_a_batch_with_sampling_params_per_prompt_counts_their_budget_and_samples() -> None:
    """SGLang takes a list of sampling_params, one per prompt: it was counted at the defaults (128 tokens, n 1),
    147 times under what 2 prompts of 8 samples of 4096 tokens hold."""
    params = {"max_new_tokens": 4096, "n": 8}
    batch = {"input_ids": [[1, 2], [3, 4]]}
    as_one = RoutingRequest("/generate", {**batch, "sampling_params": params}).tokens
    assert RoutingRequest("/generate", {**batch, "sampling_params": [params, params]}).tokens == as_one
    assert as_one == 2 * 8 * (2 + 4096)
