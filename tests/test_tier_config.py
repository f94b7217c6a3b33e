"""The shared-tier flags: --kv-tier-key-file reaches every replica's engine config and a bad key file is a one-line
usage error; a Redis password never shows in the logged settings."""

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
