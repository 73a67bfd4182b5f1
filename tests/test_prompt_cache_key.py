"""`prompt_cache_key` as a routing hint for the shared queue (issue 36), at the store, on both
backends.

What these tests prove:

- the key a task is created with is its `cache_key` (64 characters fit), and the claim returns
  it (a claim still unpacks as (task id, owner));
- without preferences a claim takes the oldest claimable tasks first, whatever their keys;
- with two runners and the tasks of keys A and B queued, the runner that served A claims A's
  tasks before older B tasks, and the other runner the B tasks;
- the preference is a head start (`rules.PREFER_HEAD_START`), not a priority: a task is never
  passed over by a preferred task created more than the head start after it, however many
  preferred tasks keep coming and however the claims are sized; a head start of 0 is oldest
  first;
- the preference never crosses the models a claim asks for; 256 keys fit in one claim;
- `RecentKeys` keeps the most recent keys, bounded.

tests/test_prompt_cache_key_services.py checks the services' part: each API's key reaches the
task, and a runner's claims prefer the keys it claimed before.
"""

from __future__ import annotations

import time

import pytest
from storehelpers import new_task, open_db, task_row

from jupyter_lmsp.services.cache_keys import RecentKeys
from jupyter_lmsp.store import rules, runners
from jupyter_lmsp.store.database import Database

HEAD_START = rules.PREFER_HEAD_START


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def worker(db: Database) -> str:
    return runners.register(db, kind="worker", lease_seconds=600).id


def queue_task(db: Database, key: str | None, created_at: float, model: str = "test-model") -> str:
    """A queued response task no runner holds (the shared queue) with this key and time."""
    task, response = new_task(created_at=created_at)
    task.cache_key = key
    task.model = model
    rules.create_task(db, task, response)
    return task.id


def _ids(claimed: list[rules.Claimed]) -> list[str]:
    return [c.task_id for c in claimed]


# ---------------------------------------------------------------------------------------------
# the store


def test_the_key_written_at_creation_is_what_the_claim_sees(db):
    t0 = time.time() - 100
    keyed = queue_task(db, "session-7", t0)
    plain = queue_task(db, None, t0 + 1)
    assert task_row(db, keyed)["cache_key"] == "session-7"
    assert task_row(db, plain)["cache_key"] is None
    claimed = rules.claim_tasks(db, worker(db), ["test-model"], limit=5)
    assert claimed == [
        rules.Claimed(keyed, "owner", "session-7"),
        rules.Claimed(plain, "owner", None),
    ]
    assert [tuple(c) for c in claimed] == [(keyed, "owner"), (plain, "owner")]
    # A 64-character key (the most the API accepts) fits on both backends.
    long_key = "k" * 64
    tid = queue_task(db, long_key, t0 + 2)
    assert rules.claim_tasks(db, worker(db), None, limit=1)[0].cache_key == long_key
    assert task_row(db, tid)["cache_key"] == long_key


def test_without_preferences_the_oldest_go_first(db):
    t0 = time.time() - 100
    order = [queue_task(db, key, t0 + i) for i, key in enumerate("ABBAB")]
    runner = worker(db)
    assert _ids(rules.claim_tasks(db, runner, ["test-model"], limit=2)) == order[:2]
    assert _ids(rules.claim_tasks(db, runner, None, limit=10)) == order[2:]


def test_a_runner_that_served_a_key_claims_its_tasks_before_older_ones(db):
    t0 = time.time() - 100
    b1, b2 = queue_task(db, "B", t0), queue_task(db, "B", t0 + 1)
    a1, a2 = queue_task(db, "A", t0 + 2), queue_task(db, "A", t0 + 3)
    other = queue_task(db, None, t0 + 4)
    served_a, served_b = worker(db), worker(db)
    # The runner that served A takes A's tasks (oldest first among them), older B's waiting.
    assert _ids(rules.claim_tasks(db, served_a, ["test-model"], limit=2, prefer=["A"])) == [a1, a2]
    # The one that served B takes B's; then the rest in age order.
    assert _ids(rules.claim_tasks(db, served_b, ["test-model"], limit=1, prefer=["B", "C"])) == [b1]
    assert _ids(rules.claim_tasks(db, served_a, None, limit=5, prefer=["A"])) == [b2, other]
    for tid, holder in ((a1, served_a), (a2, served_a), (b1, served_b), (b2, served_a)):
        assert task_row(db, tid)["runner_id"] == holder
    assert rules.claim_tasks(db, served_b, None, limit=5, prefer=["B"]) == []


def test_a_preferred_task_passes_only_tasks_created_within_the_head_start(db):
    t0 = time.time() - 1000
    old_b = queue_task(db, "B", t0)
    # Created just more than the head start after the B task: it does not pass it.
    late_a = queue_task(db, "A", t0 + HEAD_START + 1)
    runner = worker(db)
    assert _ids(rules.claim_tasks(db, runner, None, limit=1, prefer=["A"])) == [old_b]
    assert _ids(rules.claim_tasks(db, runner, None, limit=1, prefer=["A"])) == [late_a]
    # Within the head start it does.
    b = queue_task(db, "B", t0 + 100)
    a = queue_task(db, "A", t0 + 100 + HEAD_START - 1)
    assert _ids(rules.claim_tasks(db, runner, None, limit=2, prefer=["A"])) == [a, b]
    # A head start of 0: oldest first, preferences or not.
    b = queue_task(db, "B", t0 + 200)
    a = queue_task(db, "A", t0 + 201)
    assert _ids(rules.claim_tasks(db, runner, None, limit=2, prefer=["A"], head_start=0)) == [
        b,
        a,
    ]


def test_a_stream_of_preferred_tasks_does_not_starve_the_others(db):
    """B tasks wait among a steady stream of A tasks, one every second, claimed one at a time
    by a runner that prefers A (the worst case: every claim can choose): each B task is
    claimed before every A task created more than the head start after it, and only A tasks
    created within the head start after it pass it."""
    t0 = time.time() - 1000
    created: dict[str, float] = {}
    keys: dict[str, str] = {}
    for i in range(60):
        tid = queue_task(db, "A", t0 + i)
        created[tid], keys[tid] = t0 + i, "A"
    for at in (t0 + 0.5, t0 + 20.5, t0 + 40.5):
        tid = queue_task(db, "B", at)
        created[tid], keys[tid] = at, "B"
    runner = worker(db)
    order: list[str] = []
    while claimed := rules.claim_tasks(db, runner, ["test-model"], limit=1, prefer=["A"]):
        order.extend(_ids(claimed))
    assert sorted(order) == sorted(created)  # every task, once
    for position, tid in enumerate(order):
        if keys[tid] != "B":
            continue
        passed = order[:position]
        # Whatever passed it was older, or a preferred task within the head start.
        assert all(
            created[p] < created[tid]
            or (keys[p] == "A" and created[p] <= created[tid] + HEAD_START)
            for p in passed
        )
        # Every older task, and every A task created beyond the head start, comes after it.
        assert all(created[p] <= created[tid] + HEAD_START for p in passed)
        assert any(created[p] > created[tid] for p in passed)  # the preference did act


def test_a_claim_with_a_large_limit_keeps_the_same_bound(db):
    t0 = time.time() - 1000
    old_b = queue_task(db, "B", t0)
    a_tasks = [queue_task(db, "A", t0 + 0.5 + i) for i in range(30)]
    claimed = _ids(rules.claim_tasks(db, worker(db), None, limit=40, prefer=["A"]))
    # The A tasks within the head start of the B task, then it, then the later A tasks.
    within = int(HEAD_START)  # the A tasks created at t0+0.5 … t0+HEAD_START-0.5
    assert claimed == [*a_tasks[:within], old_b, *a_tasks[within:]]


def test_preferences_never_cross_the_models_asked_for(db):
    t0 = time.time() - 100
    queue_task(db, "A", t0 + 1, model="other-model")
    b = queue_task(db, "B", t0 + 2)
    runner = worker(db)
    assert _ids(rules.claim_tasks(db, runner, ["test-model"], limit=5, prefer=["A"])) == [b]
    assert rules.claim_tasks(db, runner, ["test-model"], limit=5, prefer=["A"]) == []


def test_many_preferred_keys_in_one_claim(db):
    t0 = time.time() - 100
    b = queue_task(db, "B", t0)
    a = queue_task(db, "key-255", t0 + 1)
    prefer = [f"key-{i}" for i in range(256)]
    assert _ids(rules.claim_tasks(db, worker(db), None, limit=5, prefer=prefer)) == [a, b]


# ---------------------------------------------------------------------------------------------
# a runner's memory


def test_recent_keys_keep_the_most_recent_ones():
    recent = RecentKeys(3)
    recent.add(["a", None, "b", "c"])
    assert recent.keys() == ["a", "b", "c"]
    recent.add(["a", "d"])  # a is served again: the newest; b is the oldest and goes
    assert recent.keys() == ["c", "a", "d"] and "b" not in recent and len(recent) == 3
