"""The block-level mode end to end: one client grants, writes and publishes
blocks; another looks them up with a hold, reads the bytes, releases."""

from __future__ import annotations

import numpy as np
import pytest
from kvd_client import Client, OutOfBlocks

BS = 16  # the tiny pool's block size


def test_published_bytes_are_read_through_a_hold_of_another_client(kvd_daemon) -> None:
    prompt = np.arange(1000, 1000 + 3 * BS, dtype=np.int32)
    with Client.connect(kvd_daemon.address) as a, Client.connect(kvd_daemon.address) as b:
        keys = a.block_keys(prompt)
        assert keys == b.block_keys(prompt)
        g = a.grant(3)
        for i, block in enumerate(g.blocks.tolist()):
            a.pool.block(block).fill_(float(i + 1))
        assert a.publish(g.hold, g.blocks, keys, prompt) == 3
        assert a.release(g.hold) == 3  # published blocks stay cached

        found = b.lookup(keys, hold=True)
        assert found.cached == 3 and found.blocks.tolist() == g.blocks.tolist()
        assert [float(b.pool.block(x).flatten()[0]) for x in found.blocks.tolist()] == [1, 2, 3]
        assert a.release(found.hold) == 3  # the hold's id is enough, from any session
        assert a.stats()["pools"]["default"]["holds"] == 0


def test_a_sequence_allocated_with_client_keys_hits_published_blocks(kvd_daemon) -> None:
    prompt = np.arange(3 * BS, dtype=np.int32)
    with Client.connect(kvd_daemon.address) as a, Client.connect(kvd_daemon.address) as b:
        g = a.grant(3)
        a.publish(g.hold, g.blocks, a.block_keys(prompt), prompt)
        a.release(g.hold)
        seq = b.allocate("s", np.concatenate([prompt, [7]]))
        assert seq.num_cached_tokens == 3 * BS
        assert seq.block_table[:3].tolist() == g.blocks.tolist()


def test_holds_are_released_when_their_client_closes(kvd_daemon) -> None:
    with Client.connect(kvd_daemon.address) as admin:
        with Client.connect(kvd_daemon.address) as a:
            a.grant(10)
            assert admin.stats()["pools"]["default"]["holds"] == 1
        assert admin.stats()["pools"]["default"]["holds"] == 0
        assert admin.stats()["blocks"]["default"]["free"] == 64


def test_a_grant_the_pool_cannot_serve_is_a_refusal(kvd_daemon) -> None:
    with Client.connect(kvd_daemon.address) as a, pytest.raises(OutOfBlocks):
        a.grant(65)
