"""The shared-tier flags: --kv-tier-key-file reaches every replica's engine config and a bad key file is a one-line
usage error; --redis-timeout reaches the Redis tier the replica builds, and a bad one is a usage error; a Redis
password never shows in the logged settings."""

from __future__ import annotations

import pytest

from cluster import cli
from cluster.config import ServeConfig


def test_key_file_flag_reaches_the_engine_config(tmp_path):
    key_file = tmp_path / "cluster.key"
    key_file.write_text("a" * 64)
    args = cli.build_parser().parse_args(["serve", "--devices", "cpu", "--kv-tier-key-file", str(key_file)])
    config = cli.config_from_args(args)
    assert config.kv_tier_key_file == str(key_file.resolve())
    assert config.engine_config("replica-1").kv_tier_key_file == str(key_file.resolve())
    assert ServeConfig(devices="cpu").engine_config("r").kv_tier_key_file is None  # default: per-machine file


@pytest.mark.parametrize("content, message", [(None, "cannot read it"), ("short", "at least 32")])
def test_bad_key_file_is_a_one_line_usage_error(tmp_path, capsys, content, message):
    key_file = tmp_path / "cluster.key"
    if content is not None:
        key_file.write_text(content)
    status = cli.main(["serve", "--devices", "cpu", "--kv-tier-key-file", str(key_file)])
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.count("\n") == 1


def test_redis_password_is_masked_in_the_logged_settings():
    config = ServeConfig(devices="cpu", redis_url="redis://:s3cret@10.0.0.5:6380/2")
    assert config.as_dict()["redis_url"] == "redis://:***@10.0.0.5:6380/2"
    assert "s3cret" not in repr(config.as_dict())
    assert ServeConfig(devices="cpu", redis_url="rediss://cache:6379/0").as_dict()["redis_url"] == \
        "rediss://cache:6379/0"


def test_redis_timeout_flag_reaches_the_tier_and_a_bad_one_is_a_usage_error(capsys):
    from replica.kv_sources import build_tiers
    from replica.tiers.seal import TierKey
    from test_tiers import make_format

    args = cli.build_parser().parse_args(["serve", "--devices", "cpu", "--redis-timeout", "2.5"])
    engine_config = cli.config_from_args(args).engine_config("replica-1")
    assert engine_config.redis_timeout_s == 2.5
    assert ServeConfig(devices="cpu").engine_config("r").redis_timeout_s == 0.5
    # nothing listens there: the tier is built (and backs off) without waiting on it
    (tier,) = build_tiers(make_format(), redis_url="redis://127.0.0.1:1/0", disk_cache_dir=None, disk_budget_bytes=0,
                          tier_key=TierKey.generate(), redis_timeout_s=engine_config.redis_timeout_s)
    try:
        connection_kwargs = tier._client.connection_pool.connection_kwargs
        assert connection_kwargs["socket_timeout"] == connection_kwargs["socket_connect_timeout"] == 2.5
    finally:
        tier.close()
    for bad in ("0", "-1", "nan", "301"):
        status = cli.main(["serve", "--devices", "cpu", "--redis-timeout", bad])
        err = capsys.readouterr().err
        assert status == 2 and "--redis-timeout" in err, (bad, err)
