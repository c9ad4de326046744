"""The PostgreSQL history against a real server: the same queries as SQLite, idempotent batches,
a server that goes away and comes back, a wrong password, and no password in any output."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from proxy.observers.history import History, HistoryReadError
from proxy.observers.history.backend import COLUMNS, row_of
from proxy.observers.history.postgres import PostgresBackend
from proxy.observers.metrics import ProxyMetrics
from proxy.observers.record_store import RecordQuery
from tests.support.history import record, written_with_retention
from tests.support.postgres import PASSWORD, PostgresServer


async def settled(history: History) -> None:
    assert await asyncio.to_thread(history.settle, 10.0), (history.written, history.dropped, history.up)


async def test_the_queries_of_sqlite_answer_from_postgresql(postgres: PostgresServer) -> None:
    history = History(postgres.url(), max_age_s=0, max_bytes=0)
    assert history.open() and history.up
    now = time.time()
    for n in range(30):
        history.on_response(record(f"r{n}", now - 30 + n, instance="a:8080" if n % 3 else "b:8080",
                                   model="m2" if n % 5 == 0 else "m", concurrency_peak=n % 4 + 1,
                                   upstream_request_id=f"up-{n}" if n == 7 else None))
    await settled(history)
    try:
        assert history.count() == 30 and history.written == 30
        page = history.page(RecordQuery(limit=8))
        assert [r.request_id for r in page.records] == [f"r{n}" for n in range(29, 21, -1)]
        rest = history.page(RecordQuery(limit=100, cursor=page.next_cursor))
        assert [r.request_id for r in rest.records] == [f"r{n}" for n in range(21, -1, -1)]
        assert rest.next_cursor is None
        only_b = history.page(RecordQuery(instance="b:8080", limit=100)).records
        assert sorted(int(r.request_id[1:]) for r in only_b) == list(range(0, 30, 3))
        assert all(r.instance == "b:8080" and r.upstream == "http://10.0.0.1:8000" for r in only_b)
        assert history.page(RecordQuery(upstream="http://10.0.0.1:8000", limit=100)).records.__len__() == 30
        assert history.page(RecordQuery(upstream="http://elsewhere", limit=100)).records == []
        both = history.page(RecordQuery(model="m2", concurrency="1", limit=100)).records
        assert sorted(r.request_id for r in both) == ["r0", "r20"]
        window = list(history.iterate(RecordQuery(since=now - 10, until=now - 5), 100))
        assert [r.request_id for r in window] == [f"r{n}" for n in range(20, 25)]  # oldest first
        found = history.get("up-7")
        assert found is not None and found.request_id == "r7" and history.get("nothing") is None
        assert found == record("r7", found.started_at, concurrency_peak=4, upstream_request_id="up-7")
    finally:
        await asyncio.to_thread(history.close)


async def test_a_batch_written_twice_adds_nothing_and_a_reused_client_id_is_a_new_record(
        postgres: PostgresServer) -> None:
    backend = PostgresBackend(postgres.url())
    backend.connect()
    try:
        now = time.time()
        batch = [record("same", now), record("other", now)]
        backend.write(batch)
        backend.write(batch)  # a commit whose answer was lost, sent again
        assert backend.count() == 2
        backend.write([record("same", now + 1)])  # the client sent its X-Request-Id again, a new request
        backend.write([record("same", now, instance="b:8080")])  # the same id at another proxy
        assert backend.count() == 4
        weird = record("nul", now, model="m\x00odel", upstream_error_detail="a\x00b \\u0000 c")
        backend.write([weird])  # PostgreSQL's text holds no NUL: written with U+FFFD in its place
        stored = backend.get("nul")
        assert stored is not None and stored.model == "m\ufffdodel"
        assert stored.upstream_error_detail == "a\ufffdb \\u0000 c"
    finally:
        backend.close()


def test_the_columns_postgresql_takes_from_the_json_are_the_rows_sqlite_writes(postgres: PostgresServer) -> None:
    """The query columns come from the record's JSON on the server's side: they must be what
    `row_of` gives SQLite, cut to the same length, for text COPY reads specially (backslashes,
    tabs, newlines, `\\N`, `\\.`), text past MAX_TEXT, non-ASCII, NUL, and times to the last bit."""
    odd = ["a\\b", "tab\there", "new\nline\r", "\\N", "\\.", "caf\u00e9 \u2603 \U0001f600", "q\"uote'",
           "x" * 600, "\u00e9" * 600, "\\" * 300, "m\x00odel"]
    records = [record(f"r{n}", 1796422099.0 + n / 7 + 1e-9 * n, model=text, upstream_request_id=text,
                      client=text if n % 2 else None, route=text, concurrency_peak=n * 13,
                      stop_reason=("eos", "length", "unknown")[n % 3], instance="" if n == 3 else f"h{n}:80",
                      upstream=None if n == 4 else "http://u:1") for n, text in enumerate(odd)]
    backend = PostgresBackend(postgres.url())
    backend.connect()
    try:
        backend.write(records)
    finally:
        backend.close()
    stored = postgres.psql(f"SELECT {', '.join(COLUMNS[:-1])} FROM llm_diag_records ORDER BY seq")
    assert stored == [tuple(map(nul_free, row_of(each)[:-1])) for each in records]
    assert [backend.get(f"r{n}") for n in range(len(odd))] == [
        replace(each, **{name: nul_free(getattr(each, name)) for name in ("model", "upstream_request_id", "client",
                                                                          "route")})
        for each in records]


def nul_free(value: object) -> object:
    """Text as PostgreSQL keeps it: U+FFFD where a NUL was."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


def test_proxies_starting_together_make_the_schema_once(postgres: PostgresServer) -> None:
    errors: list[BaseException] = []

    def connect() -> None:
        backend = PostgresBackend(postgres.url())
        try:
            backend.connect()
            backend.write([record(f"t{threading.get_ident()}", time.time())])
        except BaseException as exc:
            errors.append(exc)
        finally:
            backend.close()

    threads = [threading.Thread(target=connect) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and PostgresBackend(postgres.url()).count() == 6


async def test_a_server_that_goes_away_costs_the_records_past_the_buffer_counted_and_comes_back(
        postgres: PostgresServer) -> None:
    with capture_logs() as logs:
        await went_away_and_back(postgres)
    events = [entry["event"] for entry in logs]
    assert events.count("history_write_failed") == 1 and events.count("history_recovered") == 1
    assert PASSWORD not in str(logs)


async def went_away_and_back(postgres: PostgresServer) -> None:
    metrics = ProxyMetrics()
    history = History(postgres.url(), max_age_s=0, max_bytes=0, metrics=metrics, buffer=50)
    assert history.open()
    history.on_response(record("before", time.time()))
    await settled(history)
    postgres.stop()
    try:
        deadline = time.monotonic() + 20
        sent = 0
        while history.up:  # the writer finds out at its next write
            history.on_response(record(f"down{sent}", time.time()))
            sent += 1
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for _ in range(200):
            history.on_response(record(f"down{sent}", time.time()))
            sent += 1
        assert metrics.history_up._value.get() == 0  # type: ignore[attr-defined]
        assert history.dropped >= sent - 50 - 1000  # past the buffer (and the one batch in hand)
        assert history.dropped >= 150
    finally:
        postgres.start()
    deadline = time.monotonic() + 40
    while not history.up or history.written + history.dropped < sent + 1:
        assert time.monotonic() < deadline, (history.up, history.written, history.dropped, sent)
        await asyncio.sleep(0.1)
    await asyncio.to_thread(history.close)
    assert history.written + history.dropped == sent + 1  # every record written or counted
    assert history.count() == history.written and history.written >= 51
    assert metrics.history_dropped._value.get() == history.dropped  # type: ignore[attr-defined]


async def test_a_wrong_password_is_one_clear_line_without_the_password(postgres: PostgresServer) -> None:
    wrong = "Wr0ng-Pass-77"
    history = History(postgres.url(password=wrong), max_age_s=0, max_bytes=0)
    with capture_logs() as logs:
        assert not history.open() and not history.up
        assert history.shown == postgres.url(password="***")
        history.on_response(record("x", time.time()))  # waits in the buffer: the writer keeps trying
        await asyncio.sleep(1.2)  # past the first retry: still one line
        await asyncio.to_thread(history.close, 1.0)
    assert history.dropped == 1
    line, lost = logs  # one line while it fails, one at the shutdown with the records it could not keep
    assert line["event"] == "history_unavailable" and "password authentication failed" in line["error"]
    assert lost["event"] == "history_records_lost" and lost["records"] == 1
    assert line["history"] == postgres.url(password="***") and wrong not in str(logs)
    with pytest.raises(HistoryReadError) as failed:
        history.page(RecordQuery())
    assert "password authentication failed" in str(failed.value) and wrong not in str(failed.value)


async def test_the_password_may_come_from_a_file_and_retention_goes_by_age(postgres: PostgresServer) -> None:
    history = History(postgres.url(password=None), max_age_s=3600, max_bytes=0, password=PASSWORD)
    now = time.time()
    await written_with_retention(history, (record(f"a{n}", now - 7200 if n < 6 else now) for n in range(10)))
    assert history.count() == 4 and {r.request_id for r in history.between(None)} == {"a6", "a7", "a8", "a9"}
    assert history.size_bytes() > 0


async def test_a_frozen_server_is_noticed_and_the_records_it_could_not_take_are_said_at_shutdown(
        postgres: PostgresServer) -> None:
    """Every PostgreSQL process stopped (TCP connects, nothing answers): the server's statement_timeout
    cannot fire and libpq waits for ever. The client's own bound on each write (`write_timeout_s`) shuts
    the socket: history_up 0 and one line within that bound; at the shutdown, the records it could not
    write are counted and said in one line, with the number."""
    metrics = ProxyMetrics()
    history = History(postgres.url(), max_age_s=0, max_bytes=0, metrics=metrics)
    assert history.open()
    history.backend.write_timeout_s = 1.0  # type: ignore[attr-defined]  (10 s as deployed)
    history.on_response(record("before", time.time()))
    await settled(history)
    postgres.freeze()
    try:
        with capture_logs() as logs:
            frozen_at = time.monotonic()
            for n in range(20):
                history.on_response(record(f"frozen{n}", time.time()))
            while history.up:
                assert time.monotonic() - frozen_at < 1.0 + 0.2 + 2.0, "the frozen server was never noticed"
                await asyncio.sleep(0.05)
            assert metrics.history_up._value.get() == 0  # type: ignore[attr-defined]
            closed_at = time.monotonic()
            await asyncio.to_thread(history.close, 1.0)
            assert time.monotonic() - closed_at < 1.0 + 1.0 + 1.0  # the grace, then the write it waited on is cut
    finally:
        postgres.thaw()
    events = [entry["event"] for entry in logs]
    assert events.count("history_write_failed") == 1, events
    (lost,) = [entry for entry in logs if entry["event"] == "history_records_lost"]
    assert lost["records"] == 20 and history.dropped == 20
    assert PASSWORD not in str(logs)
