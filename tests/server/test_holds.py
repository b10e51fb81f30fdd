"""kvd.server.holds: the block-level kinds through the dispatcher, on a real engine and pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvd_client import wire
from kvd_client.wire.hashing import DEFAULT_HASH_SEED, BlockHasher

from tests.server.test_dispatch import BS, Harness, _config, table, toks

HASHER = BlockHasher(BS, DEFAULT_HASH_SEED)


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(_config())
    harness.hello(b"A")
    harness.hello(b"B")
    yield harness
    harness.close()


def keys(n_blocks: int, start: int = 0, namespace: str = "") -> list[bytes]:
    return HASHER.keys(toks(n_blocks * BS, start), None, namespace=namespace)


def grant(h: Harness, n: int, who: bytes = b"A") -> tuple[int, list[int]]:
    r = h.ok(wire.GrantRequest(id=h.nid(), n=n), who)
    return r["hold"], table(r, "blocks")


def publish(h: Harness, hold: int, blocks: list[int], n_blocks: int, who: bytes = b"A") -> Any:
    req = wire.PublishRequest(
        id=h.nid(),
        hold=hold,
        blocks=np.array(blocks, dtype="<i4"),
        keys=keys(n_blocks),
        tokens=toks(n_blocks * BS),
    )
    return h.ok(req, who)["published"]


def test_published_blocks_are_found_and_held_by_another_session(h: Harness) -> None:
    hold, blocks = grant(h, 2)
    assert publish(h, hold, blocks, 2) == 2
    r = h.ok(wire.LookupRequest(id=h.nid(), keys=keys(3), hold=True), b"B")
    assert r["cached"] == 2 and table(r, "blocks") == blocks and r["hold"]
    h.d.state.pools["default"].engine.check_invariants()


def test_lookup_without_hold_holds_nothing(h: Harness) -> None:
    hold, blocks = grant(h, 1)
    publish(h, hold, blocks, 1)
    r = h.ok(wire.LookupRequest(id=h.nid(), keys=keys(1)), b"B")
    assert (r["cached"], r["blocks"], r["hold"]) == (1, b"", 0)


def test_the_reader_releases_a_hold_made_by_another_session(h: Harness) -> None:
    hold, _ = grant(h, 2)
    pool = h.state()["pools"]["default"]
    assert (pool["holds"], pool["held_blocks"]) == (1, 2)
    assert h.ok(wire.ReleaseRequest(id=h.nid(), hold=hold), b"B") == {"released": 2}
    pool = h.state()["pools"]["default"]
    assert (pool["holds"], pool["held_blocks"]) == (0, 0)
    assert h.state()["blocks"]["default"]["free"] == 16
    # gone already: nothing, not an error
    assert h.ok(wire.ReleaseRequest(id=h.nid(), hold=hold), b"A") == {"released": 0}


def test_a_hold_of_another_namespace_is_not_found(h: Harness) -> None:
    h.hello(b"C", namespace="other")
    hold, _ = grant(h, 1)
    assert h.ok(wire.ReleaseRequest(id=h.nid(), hold=hold), b"C") == {"released": 0}
    assert h.ok(wire.ReleaseRequest(id=h.nid(), hold=hold), b"A") == {"released": 1}


def test_keys_not_a_multiple_of_the_key_size_are_invalid(h: Harness) -> None:
    frames = wire.LookupRequest(id=h.nid(), keys=keys(1)).encode()
    frames[2] = frames[2][:-1]
    assert h.err(frames).code == wire.Code.INVALID


def test_grant_beyond_the_pool_is_refused_and_changes_nothing(h: Harness) -> None:
    before = h.state()
    assert h.err(wire.GrantRequest(id=h.nid(), n=17)).code == wire.Code.OUT_OF_BLOCKS
    assert h.state() == before


def test_publish_of_a_block_outside_the_hold_is_invalid_and_changes_nothing(h: Harness) -> None:
    hold, blocks = grant(h, 1)
    before = h.state()
    req = wire.PublishRequest(
        id=h.nid(),
        hold=hold,
        blocks=np.array([blocks[0] + 1], dtype="<i4"),
        keys=keys(1),
        tokens=toks(BS),
    )
    assert h.err(req).code == wire.Code.INVALID
    assert h.state() == before


def test_grant_above_the_per_request_token_limit_is_too_large() -> None:
    harness = Harness(_config(**{"security.max_tokens_per_request": str(4 * BS)}))
    try:
        harness.hello()
        err = harness.err(wire.GrantRequest(id=harness.nid(), n=5))
        assert err.code == wire.Code.TOO_LARGE
    finally:
        harness.close()


def test_grant_is_refused_while_draining(h: Harness) -> None:
    h.d.state.draining = True
    assert h.err(wire.GrantRequest(id=h.nid(), n=1)).code == wire.Code.SHUTTING_DOWN


def test_block_level_ops_run_in_one_batch(h: Harness) -> None:
    hold, blocks = grant(h, 2)
    ops = [
        wire.PublishRequest(
            id=0,
            hold=hold,
            blocks=np.array(blocks, dtype="<i4"),
            keys=keys(2),
            tokens=toks(2 * BS),
        ),
        wire.LookupRequest(id=0, keys=keys(2), hold=True),
        wire.ReleaseRequest(id=0, hold=hold),
    ]
    reply = h.send(wire.encode_batch(h.nid(), ops))
    results = reply.result["results"]
    assert [r["ok"] for r in results] == [True, True, True]
    assert results[0]["r"] == {"published": 2}
    assert results[1]["r"]["cached"] == 2
    assert results[2]["r"] == {"released": 2}


def test_allocate_with_client_keys_matches_what_the_daemon_hashed(h: Harness) -> None:
    h.ok(wire.AllocateRequest(id=h.nid(), seq="a", tokens=toks(3 * BS)))
    h.ok(wire.CommitRequest(id=h.nid(), seq="a"))
    prompt = toks(3 * BS + 1)
    r = h.ok(wire.AllocateRequest(id=h.nid(), seq="b", tokens=prompt, keys=keys(3)), b"B")
    assert r["cached"] == 3 * BS


def test_allocate_with_the_wrong_number_of_keys_is_invalid_and_changes_nothing(
    h: Harness,
) -> None:
    before = h.state()
    req = wire.AllocateRequest(id=h.nid(), seq="a", tokens=toks(3 * BS), keys=keys(2))
    assert h.err(req).code == wire.Code.INVALID
    assert h.state() == before


def test_a_protocol_2_client_is_refused_with_version() -> None:
    harness = Harness(_config())
    try:
        reply = harness.hello(version=2)
        assert isinstance(reply, wire.ErrorReply) and reply.code == wire.Code.VERSION
    finally:
        harness.close()
