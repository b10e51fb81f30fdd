"""Two client processes share a prefix through the daemon and the pool's memory."""

from __future__ import annotations

BS = 16  # the tiny pool's block size


def test_second_process_reads_the_first_ones_kv_bytes(kvd_daemon, spawn_agent) -> None:
    a, b = spawn_agent(), spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    b.ok("connect", address=kvd_daemon.address)
    prompt = list(range(100, 140))  # 2 full blocks + 8 tokens
    ra = a.ok("allocate", seq="req-a", tokens=prompt)
    assert ra["cached"] == 0
    for pos in range(40):
        a.ok("fill", seq="req-a", start=pos, stop=pos + 1, value=float(pos + 1))
    assert a.ok("commit", seq="req-a") == {"committed": 40, "cached_blocks": 2}

    rb = b.ok("allocate", seq="req-b", tokens=[*prompt, 7, 8, 9])
    # the two full committed blocks are shared; the partial third one never is
    assert rb["cached"] == 2 * BS
    assert rb["table"][:2] == ra["table"][:2]
    assert rb["table"][2] != ra["table"][2]
    values = b.ok("read", seq="req-b", start=0, stop=2 * BS)["values"]
    assert values == [float(pos + 1) for pos in range(2 * BS)]


def test_hit_is_capped_so_the_last_token_is_computed(kvd_daemon, spawn_agent) -> None:
    a, b = spawn_agent(), spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    b.ok("connect", address=kvd_daemon.address)
    prompt = list(range(2 * BS))
    a.ok("allocate", seq="s", tokens=prompt)
    a.ok("commit", seq="s")
    assert b.ok("allocate", seq="s", tokens=prompt)["cached"] == BS


def test_committed_blocks_outlive_their_writer(kvd_daemon, spawn_agent) -> None:
    a = spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    prompt = list(range(3 * BS))
    a.ok("allocate", seq="s", tokens=prompt)
    a.ok("fill", seq="s", start=0, stop=3 * BS, value=3.0)
    a.ok("commit", seq="s")
    a.ok("close")
    a.stop()
    b = spawn_agent()
    b.ok("connect", address=kvd_daemon.address)
    rb = b.ok("allocate", seq="s", tokens=[*prompt, 1])
    assert rb["cached"] == 3 * BS
    assert set(b.ok("read", seq="s", start=0, stop=3 * BS)["values"]) == {3.0}


def test_fork_and_copy_on_write_across_processes(kvd_daemon, spawn_agent) -> None:
    a, b = spawn_agent(), spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    b.ok("connect", address=kvd_daemon.address)
    prompt = list(range(2 * BS))
    ra = a.ok("allocate", seq="s", tokens=prompt)
    a.ok("fill", seq="s", start=0, stop=2 * BS, value=1.0)
    a.ok("commit", seq="s")

    # B shares A's first block through the prefix cache, then rewrites part of it:
    # the daemon moves B to a private copy first, which B's client fills from A's bytes.
    rb = b.ok("allocate", seq="s", tokens=prompt)
    assert rb["table"][0] == ra["table"][0]
    b.ok("truncate", seq="s", n=10)
    after = b.ok("append", seq="s", tokens=[9, 9, 9, 9])["table"]
    assert after[0] != ra["table"][0]
    b.ok("fill", seq="s", start=10, stop=14, value=2.0)
    assert b.ok("read", seq="s", start=0, stop=14)["values"] == [1.0] * 10 + [2.0] * 4
    # A's block is untouched
    assert a.ok("read", seq="s", start=0, stop=2 * BS)["values"] == [1.0] * (2 * BS)

    # Within A: a fork shares every block; appending to the child copies its
    # shared partial last block, leaving the parent's bytes alone.
    a.ok("truncate", seq="s", n=20)
    child = a.ok("fork", seq="s", child="c")["table"]
    assert child == a.ok("table", seq="s")["table"]
    grown = a.ok("append", seq="c", tokens=[5])["table"]
    assert grown[1] != child[1]
    a.ok("fill", seq="c", start=20, stop=21, value=4.0)
    assert a.ok("read", seq="c", start=16, stop=21)["values"] == [1.0] * 4 + [4.0]
    assert a.ok("read", seq="s", start=16, stop=20)["values"] == [1.0] * 4
    assert kvd_daemon.check()["ok"] is True


def test_allocate_with_the_callers_keys_hits_as_with_its_own(kvd_daemon) -> None:
    """``allocate(keys=...)``: keys hashed once by the caller (as vLLM's frontend
    does) give the same hit as the keys the client computes itself."""
    import numpy as np
    from kvd_client import Client

    prompt = np.arange(5000, 5000 + 4 * 16 + 3, dtype=np.int32)
    with Client.connect(kvd_daemon.address) as a, Client.connect(kvd_daemon.address) as b:
        first = a.allocate("w", prompt)
        first.commit()
        keys = b.block_keys(prompt)
        seq = b.allocate("r", prompt, keys=keys)
        assert seq.num_cached_tokens == 4 * 16
        assert seq.block_table[:4].tolist() == first.block_table[:4].tolist()
        seq.free()
        with b.batch() as batch:
            d = batch.allocate("r2", prompt, keys=keys)
        assert d.result().num_cached_tokens == 4 * 16
