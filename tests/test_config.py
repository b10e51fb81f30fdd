"""kvd.config: defaults, the documented file, overrides and errors naming the key."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvd.config import Config, PoolConfig, load_config
from kvd.errors import ConfigError

CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "kvd.toml"


def _keys(value: Any, prefix: str = "") -> set[str]:
    """Dotted key names of a dataclass tree (pool entries as ``pools[]``)."""
    keys: set[str] = set()
    for f in dataclasses.fields(value):
        child = getattr(value, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(child):
            keys |= _keys(child, f"{name}.")
        elif f.name == "pools":
            keys |= _keys(child[0], "pools[].")
        else:
            keys.add(name)
    return keys


def _toml_keys(raw: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for k, v in raw.items():
        name = f"{prefix}{k}"
        if k == "namespaces":
            keys.add(name)
        elif type(v) is dict:
            keys |= _toml_keys(v, f"{name}.")
        elif k == "pools":
            keys |= _toml_keys(v[0], "pools[].")
        else:
            keys.add(name)
    return keys


def test_documented_file_equals_embedded_defaults() -> None:
    assert load_config(CONFIG_FILE, env={}) == Config()


def test_documented_file_lists_every_key() -> None:
    raw = tomllib.loads(CONFIG_FILE.read_text())
    assert _toml_keys(raw) == _keys(Config())


def test_default_pool_is_256_mib() -> None:
    (pool,) = Config().pools
    assert pool.layout.total_bytes == 256 * 1024 * 1024


def test_no_file_no_env_gives_defaults() -> None:
    assert load_config(env={}) == Config()


def test_file_values_override_defaults(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('[server]\nlease_ms = 1500\n[log]\nlevel = "debug"\n')
    config = load_config(path, env={})
    assert config.server.lease_ms == 1500
    assert config.log.level == "debug"
    assert config.server.drain_timeout_s == Config().server.drain_timeout_s


def test_pools_in_a_file_replace_the_default_list(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('[[pools]]\nname = "a"\nnum_blocks = 8\n[[pools]]\nname = "b"\n')
    config = load_config(path, env={})
    assert [p.name for p in config.pools] == ["a", "b"]
    assert config.pools[0].num_blocks == 8
    assert config.pools[1].num_blocks == PoolConfig().num_blocks


def test_environment_overrides_file(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text("[server]\nlease_ms = 1500\n")
    env = {
        "KVD_SERVER__LEASE_MS": "2500",
        "KVD_SERVER__ADDRESS": "ipc:///tmp/x.sock",
        "KVD_POOLS__0__NUM_BLOCKS": "32",
        "KVD_ADMISSION__PRESSURE_THRESHOLDS": "[0.5, 0.75]",
        "KVD_CONFIG": "ignored: no __ in the name",
    }
    config = load_config(path, env=env)
    assert config.server.lease_ms == 2500
    assert config.server.address == "ipc:///tmp/x.sock"
    assert config.pools[0].num_blocks == 32
    assert config.admission.pressure_thresholds == (0.5, 0.75)


def test_overrides_win_over_environment() -> None:
    config = load_config(
        env={"KVD_SERVER__LEASE_MS": "2500"}, overrides={"server.lease_ms": "3500"}
    )
    assert config.server.lease_ms == 3500


def test_string_override_is_taken_verbatim() -> None:
    config = load_config(env={}, overrides={"cache.hash_seed": "123"})
    assert config.cache.hash_seed == "123"


def test_namespace_limits_from_file(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text("[admission.namespaces.tenant-a]\nquota_blocks = 64\nminimum_blocks = 8\n")
    limits = load_config(path, env={}).admission.namespaces["tenant-a"]
    assert (limits.quota_blocks, limits.minimum_blocks) == (64, 8)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nleese_ms = 1\n", "server.leese_ms"),
        ("[servr]\n", "servr"),
        ("[server]\nlease_ms = 0\n", "server.lease_ms"),
        ('[server]\nlease_ms = "5000"\n', "server.lease_ms"),
        ("[server]\nallow_public_tcp = 1\n", "server.allow_public_tcp"),
        ('[server]\naddress = "http://x"\n', "server.address"),
        ('[server]\ntcp_address = "tcp://0.0.0.0:5555"\n', "server.tcp_address"),
        ('[log]\nlevel = "loud"\n', "log.level"),
        ("[admission]\npressure_thresholds = [0.9, 0.8]\n", "admission.pressure_thresholds"),
        ("[admission.namespaces.t]\nquota_blocks = -1\n", "admission.namespaces.t.quota_blocks"),
        ("[memory]\nbudget_bytes = -1\n", "memory.budget_bytes"),
        ("[[pools]]\nnum_blocks = 0\n", "pools[0].num_blocks"),
        ('[[pools]]\ndtype = "int4"\n', "pools[0].dtype"),
        ('[[pools]]\nname = "a/b"\n', "pools[0].name"),
        ('[[pools]]\nbackend = "nvme"\n', "pools[0].backend"),
        ('[[pools]]\nname = "a"\n[[pools]]\nname = "a"\n', "pools[1].name"),
        ("pools = []\n", "pools"),
        ("[metrics]\nport = 70000\n", "metrics.port"),
        ("[events]\nbuffer = 0\n", "events.buffer"),
        ('[tiers.remote]\nurl = "http://x"\n', "tiers.remote.url"),
        ("[tiers.remote]\ntimeout_s = 0\n", "tiers.remote.timeout_s"),
        ('[tiers.remote]\nurl = "mooncake://m"\n', "tiers.remote.url"),
        ('[tiers.remote]\nurl = "mooncake://m:1?segment_mb=0"\n', "tiers.remote.url"),
        ('[tiers.remote]\nurl = "mooncake://m:1"\nttl_s = 60\n', "tiers.remote.ttl_s"),
        ('[tiers.remote]\nurl = "mooncake://m:1?segment_mb=4096"\n', "tiers.remote.url"),
        ("[[pools]]\nremote_tier = true\n", "pools[0].remote_tier"),
        ('[[pools]]\nremote_tier = true\nbackend = "cuda"\n', "pools[0].remote_tier"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_a_host_tier_chains_onto_the_remote_one() -> None:
    config = load_config(
        env={},
        overrides={
            "pools.0.tier_blocks": "8",
            "pools.0.remote_tier": "true",
            "tiers.remote.url": "redis://127.0.0.1:6379/0",
        },
    )
    assert (config.pools[0].tier_blocks, config.pools[0].remote_tier) == (8, True)


def test_a_mooncake_store_is_a_remote_tier() -> None:
    url = "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&segment_mb=96"
    config = load_config(env={}, overrides={"pools.0.remote_tier": "true", "tiers.remote.url": url})
    assert config.tiers.remote.url == url


_CURVE = {"server.curve_secret_key_file": "/k/server.key_secret", "server.curve_clients_dir": "/k"}


def test_public_tcp_allowed_when_explicit() -> None:
    config = load_config(
        env={},
        overrides={
            **_CURVE,
            "server.allow_public_tcp": "true",
            "server.tcp_address": "tcp://0.0.0.0:5555",
        },
    )
    assert config.server.tcp_address == "tcp://0.0.0.0:5555"


@pytest.mark.parametrize(
    "overrides",
    [
        {"server.tcp_address": "tcp://127.0.0.1:5555"},
        {"server.address": "tcp://127.0.0.1:5555"},
        {"server.tcp_address": "tcp://127.0.0.1:5555", "server.curve_clients_dir": "/k"},
        {"server.address": "tcp://127.0.0.1:5555", "server.curve_secret_key_file": "/k/s"},
    ],
)
def test_a_tcp_endpoint_without_curve_is_refused(overrides: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    assert info.value.key == "server.curve_secret_key_file"
    assert "CURVE" in info.value.message


@pytest.mark.parametrize("key", ["server.tcp_address", "server.address"])
def test_a_tcp_endpoint_with_curve_is_accepted(key: str) -> None:
    config = load_config(env={}, overrides={**_CURVE, key: "tcp://127.0.0.1:5555"})
    assert config.server.curve_clients_dir == "/k"


def test_security_defaults_enforce_nothing_but_the_per_session_caps() -> None:
    sec = Config().security
    assert not sec.enforce_namespaces
    assert (sec.namespaces, sec.admins, sec.rate_limit) == ({}, (), 0.0)
    assert sec.max_tokens_per_request == 0
    assert sec.max_sequences_per_session == 4096
    assert sec.max_held_blocks_per_session == 1 << 20


def test_security_section_from_file(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(
        '[security]\nenforce_namespaces = true\nadmins = ["uid:0"]\nrate_limit = 50\n'
        '[security.namespaces]\n"uid:1000" = ["tenant-a", "ml/*"]\n"*" = [""]\n'
    )
    sec = load_config(path, env={}).security
    assert sec.enforce_namespaces
    assert sec.namespaces == {"uid:1000": ("tenant-a", "ml/*"), "*": ("",)}
    assert sec.admins == ("uid:0",)
    assert sec.rate_limit == 50.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[security]\nrate_limit = -1\n", "security.rate_limit"),
        ("[security]\nrate_burst = 0\n", "security.rate_burst"),
        ("[security]\nmax_tokens_per_request = -1\n", "security.max_tokens_per_request"),
        ("[security]\nmax_sequences_per_session = -1\n", "security.max_sequences_per_session"),
        ("[security]\nmax_held_blocks_per_session = -1\n", "security.max_held_blocks_per_session"),
        ('[security]\nadmins = ["root"]\n', "security.admins"),
        ('[security]\nadmins = "uid:0"\n', "security.admins"),
        ('[security.namespaces]\n"uid:x" = ["a"]\n', "security.namespaces.uid:x"),
        ('[security.namespaces]\n"uid:1" = ["a*b"]\n', "security.namespaces.uid:1"),
        ('[security.namespaces]\n"uid:1" = "a"\n', "security.namespaces.uid:1"),
        ('[security.namespaces]\n"key:short" = ["a"]\n', "security.namespaces.key:short"),
    ],
)
def test_bad_security_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == key


def test_unknown_environment_key_fails() -> None:
    with pytest.raises(ConfigError, match=r"server\.leasems: unknown key"):
        load_config(env={"KVD_SERVER__LEASEMS": "1"})


def test_unparsable_override_fails() -> None:
    with pytest.raises(ConfigError, match=r"server\.lease_ms"):
        load_config(env={}, overrides={"server.lease_ms": "[1"})


def test_missing_pool_index_fails() -> None:
    with pytest.raises(ConfigError, match="no list entry"):
        load_config(env={"KVD_POOLS__3__NAME": "x"})


def test_unreadable_file_fails(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml", env={})


def test_invalid_toml_fails(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


def test_pool_lookup_by_name() -> None:
    config = Config()
    assert config.pool("default") is config.pools[0]
    with pytest.raises(KeyError):
        config.pool("absent")


@pytest.mark.parametrize("text", ["block_major", '"block_major"'])
def test_string_overrides_take_bare_or_quoted_text(text: str) -> None:
    cfg = load_config(env={}, overrides={"pools.0.order": text})
    assert cfg.pools[0].order == "block_major"


def test_quoted_string_override_loses_its_quotes() -> None:
    cfg = load_config(env={}, overrides={"pools.0.dtype": '"float32"'})
    assert cfg.pools[0].dtype == "float32"
