"""Finding the local processes that serve the upstream, for GPU attribution."""

from __future__ import annotations

import os

from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.observers.telemetry.pids import listening_inodes, local_port, parent_of, upstream_pids, with_descendants

TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41001 1 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 41002 1 0
   2: 00000000:2CCB 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 41003 1 0
"""


def test_listening_inodes_are_those_in_listen_state_on_the_port() -> None:
    assert listening_inodes(TCP_TABLE, 8080) == {41001}  # the established socket on 8080 is not listening
    assert listening_inodes(TCP_TABLE, 11467) == {41003}
    assert listening_inodes(TCP_TABLE, 1) == set()


def test_parent_of_reads_the_ppid_even_when_comm_holds_spaces_and_parentheses() -> None:
    assert parent_of("4242 (vllm (engine) core) S 4000 4242 4000 0 -1 4194560") == 4000
    assert parent_of("garbage") is None


def test_descendants_include_children_and_grandchildren_only() -> None:
    parents = {2: 1, 3: 2, 4: 3, 5: 1, 6: 99}
    assert with_descendants(parents, [2]) == frozenset({2, 3, 4})
    assert with_descendants(parents, []) == frozenset()


def test_only_loopback_upstreams_have_a_local_port() -> None:
    assert local_port("http://127.0.0.1:8000") == 8000
    assert local_port("http://localhost:11434/") == 11434
    assert local_port("http://[::1]:9000") == 9000
    assert local_port("http://127.0.0.1") == 80
    assert local_port("https://127.0.0.1") == 443
    assert local_port("http://10.0.0.5:8000") is None
    assert local_port("http://gpu-box:8000") is None


async def test_the_process_listening_on_a_loopback_upstream_is_found() -> None:
    server = TestServer(web.Application(), host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        assert os.getpid() in upstream_pids(url)
    finally:
        await server.close()


def test_a_remote_upstream_has_no_known_pids() -> None:
    assert upstream_pids("http://192.0.2.1:8000") == frozenset()
