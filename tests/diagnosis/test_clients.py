"""Who sent a request: a keyed hash of its API key (never the key), or a header the operator names."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from multidict import CIMultiDict

from proxy.diagnosis.clients import ClientNamer, load_secret

SECRET = b"s" * 32


def test_the_same_key_is_the_same_client_however_it_is_sent_and_another_key_another() -> None:
    namer = ClientNamer(SECRET)
    bearer = namer.name(CIMultiDict({"Authorization": "Bearer sk-live-alice-123"}))
    assert bearer is not None and bearer.startswith("key:") and len(bearer) == 16
    assert namer.name(CIMultiDict({"x-api-key": "sk-live-alice-123"})) == bearer  # Anthropic's header
    assert namer.name(CIMultiDict({"API-Key": "sk-live-alice-123"})) == bearer  # Azure's
    assert namer.name(CIMultiDict({"Authorization": "Bearer sk-live-bob-456"})) not in (bearer, None)
    assert ClientNamer(b"t" * 32).name(CIMultiDict({"Authorization": "Bearer sk-live-alice-123"})) != bearer
    assert namer.name(CIMultiDict()) is None
    assert "alice" not in bearer and "sk-" not in bearer


def test_a_named_header_names_the_client_and_a_credential_header_cannot_be_named() -> None:
    namer = ClientNamer(SECRET, "X-Client-Id")
    assert namer.name(CIMultiDict({"x-client-id": "team-search", "Authorization": "Bearer k"})) == "team-search"
    assert namer.name(CIMultiDict({"Authorization": "Bearer k"})).startswith("key:")  # type: ignore[union-attr]
    assert namer.name(CIMultiDict({"X-Client-Id": "x" * 500})) == "x" * 64
    for header in ("Authorization", "x-api-key", "Cookie", "proxy-authorization"):
        with pytest.raises(ValueError):
            ClientNamer(SECRET, header)


def test_the_secret_is_made_once_private_and_kept(tmp_path: Path) -> None:
    first, note = load_secret(None, tmp_path / "state")
    assert note is None and len(first) == 32
    assert stat.S_IMODE((tmp_path / "state" / "client-secret").stat().st_mode) == 0o600
    assert load_secret(None, tmp_path / "state") == (first, None)
    shared = tmp_path / "fleet-secret"
    shared.write_bytes(b"0123456789abcdef0123\n")
    assert load_secret(str(shared), tmp_path / "elsewhere") == (b"0123456789abcdef0123", None)
    shared.write_bytes(b"short")
    with pytest.raises(ValueError):
        load_secret(str(shared), tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    secret, note = load_secret(None, blocked / "state")  # cannot be made: this process's own, said
    assert len(secret) == 32 and note is not None


@pytest.mark.parametrize("stored", [b"", b"x", b"fifteen-bytes!!"])
def test_a_secret_too_short_is_made_again_once_with_one_line(tmp_path: Path, stored: bytes) -> None:
    """An empty file (a crash at the first start) or one cut short was used as it was: every process
    drew a fresh secret for an empty one (a key renamed at each restart, and twice with --workers 2),
    and a 1-byte one became the HMAC key."""
    from structlog.testing import capture_logs

    state = tmp_path / "state"
    state.mkdir()
    (state / "client-secret").write_bytes(stored)
    with capture_logs() as logs:
        first, note = load_secret(None, state)
        again, _ = load_secret(None, state)
    assert note is None and len(first) == 32 and again == first == (state / "client-secret").read_bytes()
    assert [entry["event"] for entry in logs] == ["client_secret_replaced"]
    assert stat.S_IMODE((state / "client-secret").stat().st_mode) == 0o600


def test_proxies_starting_together_on_a_short_secret_agree_on_one(tmp_path: Path) -> None:
    import threading

    state = tmp_path / "state"
    state.mkdir()
    (state / "client-secret").write_bytes(b"")
    found: list[bytes] = []
    threads = [threading.Thread(target=lambda: found.append(load_secret(None, state)[0])) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == 1 and len(found[0]) == 32


def test_a_header_value_never_takes_a_keyed_hashs_name() -> None:
    namer = ClientNamer(SECRET, "X-Client-Id")
    someone = ClientNamer(SECRET).name(CIMultiDict({"Authorization": "Bearer sk-someone"}))
    assert someone is not None
    impostor = namer.name(CIMultiDict({"X-Client-Id": someone}))
    assert impostor == "header:" + someone and impostor != someone
    assert namer.name(CIMultiDict({"X-Client-Id": "KEY:abc"})) == "header:KEY:abc"


@pytest.mark.parametrize("header", ["Ocp-Apim-Subscription-Key", "X-Auth-Token", "X-Api-Secret", "Session-Id",
                                    "X-Session-Token", "Authorization-Extra", "Set-Cookie", "X-Password"])
def test_a_header_whose_name_says_credential_cannot_be_named(header: str) -> None:
    with pytest.raises(ValueError):
        ClientNamer(SECRET, header)


def test_a_secret_too_short_is_refused_where_it_would_be_the_key() -> None:
    with pytest.raises(ValueError):
        ClientNamer(b"x")
