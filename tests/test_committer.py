"""The runner's database thread (`services.committer`): jobs run in the order asked for, off
the event loop, their results come back on the loop in the same order, and a job that finds
the database locked runs again before any later job."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

from jupyter_lmsp.services.committer import Committer


def test_jobs_run_in_order_off_the_loop_and_results_come_back_in_order():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        committer = Committer("test-db")
        committer.start(loop)
        ran: list[tuple[int, str]] = []
        back: list[int] = []
        done = asyncio.Event()

        def job(i: int) -> int:
            ran.append((i, threading.current_thread().name))
            return i

        def then(i: int) -> None:
            assert threading.current_thread() is threading.main_thread()
            back.append(i)
            if i == 99:
                done.set()

        for i in range(100):
            committer.run(job, i, then=then)
        await asyncio.wait_for(done.wait(), 10)
        assert [i for i, _ in ran] == list(range(100)) == back
        assert {name for _, name in ran} == {"test-db"}
        assert await committer.call(lambda: "direct") == "direct"
        committer.stop()

    asyncio.run(run())


def test_a_job_that_finds_the_database_locked_runs_again_before_the_next(caplog):
    async def run() -> None:
        committer = Committer("test-db")
        committer.start(asyncio.get_running_loop())
        order: list[str] = []
        tries = {"n": 0}

        def flaky() -> str:
            tries["n"] += 1
            if tries["n"] < 3:
                raise sqlite3.OperationalError("database is locked")
            order.append("flaky")
            return "ok"

        def broken() -> None:
            raise ValueError("not a lock")

        committer.run(flaky)
        committer.run(broken)  # logged, and the queue goes on
        committer.run(order.append, "next")
        assert await committer.call(lambda: "end") == "end"
        assert order == ["flaky", "next"] and tries["n"] == 3
        committer.stop()

    asyncio.run(run())
    assert "stayed locked" in caplog.text and "not a lock" in caplog.text


def test_jobs_waiting_together_commit_as_one_group_each_rule_alone_in_it(tmp_path):
    """Issue 42: the jobs queued when the thread turns to them run in one transaction (one
    commit), each rule in a savepoint: one that raises changes nothing and gets its
    `on_error`, the others' writes commit, nothing is visible outside before the group's
    commit, and the results come back in order after it."""
    from sqlalchemy import text

    from jupyter_lmsp.store.database import Database, sqlite_url

    path = tmp_path / "group.sqlite"
    db = Database(sqlite_url(path))
    with db.writing() as conn:
        conn.execute(text("CREATE TABLE marks (n INTEGER)"))

    def mark(n: int) -> int:
        with db.writing() as conn:
            conn.execute(text("INSERT INTO marks VALUES (:n)"), {"n": n})
        return n

    def mark_then_fail(n: int) -> None:
        with db.writing() as conn:
            conn.execute(text("INSERT INTO marks VALUES (:n)"), {"n": n})
            raise ValueError("the rule refused")

    def seen() -> tuple[list[int], int]:
        # Inside the group its reads see its writes; another connection sees none yet.
        with db.reading() as conn:
            mine = sorted(conn.execute(text("SELECT n FROM marks")).scalars())
        outside = sqlite3.connect(path).execute("SELECT count(*) FROM marks").fetchone()[0]
        return mine, outside

    async def run() -> None:
        committer = Committer("test-db", group=db.grouped)
        committer.start(asyncio.get_running_loop())
        gate = threading.Event()
        back: list[object] = []
        committer.run(gate.wait, 10)  # holds the thread while the others queue up
        committer.run(mark, 1, then=back.append)
        committer.run(mark_then_fail, 2, then=back.append, on_error=back.append)
        committer.run(mark, 3, then=back.append)
        committer.run(seen, then=back.append)
        gate.set()
        assert await committer.call(lambda: "end") == "end"
        assert back[0] == 1 and isinstance(back[1], ValueError) and back[2] == 3
        assert back[3] == ([1, 3], 0)
        committer.stop()

    asyncio.run(run())
    with db.reading() as conn:
        assert sorted(conn.execute(text("SELECT n FROM marks")).scalars()) == [1, 3]
    db.dispose()


def test_a_job_locked_in_a_group_runs_alone_after_those_before_it_commit(tmp_path):
    """A job of a group that finds the database locked stops the group there: the jobs
    before it commit, it runs again alone (and again while locked), then the rest."""
    from sqlalchemy import text

    from jupyter_lmsp.store.database import Database, sqlite_url

    db = Database(sqlite_url(tmp_path / "locked.sqlite"))
    with db.writing() as conn:
        conn.execute(text("CREATE TABLE marks (n INTEGER)"))
    tries = {"n": 0}

    def mark(n: int) -> int:
        with db.writing() as conn:
            conn.execute(text("INSERT INTO marks VALUES (:n)"), {"n": n})
        return n

    def flaky() -> int:
        tries["n"] += 1
        if tries["n"] < 3:
            raise sqlite3.OperationalError("database is locked")
        return mark(2)

    async def run() -> list[int]:
        committer = Committer("test-db", group=db.grouped)
        committer.start(asyncio.get_running_loop())
        gate = threading.Event()
        back: list[int] = []
        committer.run(gate.wait, 10)
        for job, args in ((mark, (1,)), (flaky, ()), (mark, (3,))):
            committer.run(job, *args, then=back.append)
        gate.set()
        assert await committer.call(lambda: "end") == "end"
        committer.stop()
        return back

    assert asyncio.run(run()) == [1, 2, 3] and tries["n"] == 3
    with db.reading() as conn:
        assert sorted(conn.execute(text("SELECT n FROM marks")).scalars()) == [1, 2, 3]
    db.dispose()
