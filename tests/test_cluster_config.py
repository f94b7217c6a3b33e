"""ServeConfig and the ``prefixserve`` command line: flag parsing, defaults, invalid combinations. No Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli
from cluster.config import ServeConfig, parse_memory_size
from replica.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent


def parse(*flags: str) -> ServeConfig:
    args = cli.build_parser().parse_args(["serve", *flags])
    return cli.config_from_args(args)


def test_defaults():
    config = parse("--devices", "cpu")
    assert config.model is None
    assert config.served_model_name == "SmolLM2-135M-Instruct"
    assert config.data_parallel_degree == 1
    assert config.enable_prefix_caching is True
    assert config.enable_dp_cross_replica_prefix_copy is True
    assert config.page_size == 128
    assert config.kv_cache_memory == 1 << 30
    assert (config.host, config.port, config.api_key, config.redis_url) == ("127.0.0.1", 8000, None, None)
    assert config.replica_transport == "grpc"


def test_every_flag_reaches_the_config(tmp_path):
    config = parse(
        "--model", str(tmp_path), "--devices", "cpu", "--data-parallel-degree", "3", "--kv-cache-page-size", "256",
        "--kv-cache-memory", "2GiB", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-model-len", "1024",
        "--max-num-batched-tokens", "512", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--redis-url", "redis://h:6379/0", "--disk-cache-dir", str(tmp_path / "kv"), "--ray-address", "auto",
        "--log-level", "debug", "--served-model-name", "m", "--num-cpus-per-replica", "2",
        "--no-enable-dp-cross-replica-prefix-copy", "--replica-transport", "ray",
    )
    assert config == ServeConfig(
        model=str(tmp_path), devices="cpu", data_parallel_degree=3, page_size=256, kv_cache_memory=2 * 1024**3,
        dtype="bfloat16", max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=512, host="0.0.0.0", port=9000,
        api_key="k", redis_url="redis://h:6379/0", disk_cache_dir=str(tmp_path / "kv"), ray_address="auto",
        log_level="debug", served_model_name="m", num_cpus_per_replica=2.0,
        enable_dp_cross_replica_prefix_copy=False, replica_transport="ray",
    )


def test_engine_config_carries_the_replica_settings():
    config = ServeConfig(devices="cpu", model="/m", page_size=256, kv_cache_memory="64MiB", max_num_seqs=4,
                         max_num_batched_tokens=300, max_model_len=1000, num_cpus_per_replica=2.5,
                         redis_url="redis://r:1/0", disk_cache_dir="/d")
    engine = config.engine_config("r1")
    assert isinstance(engine, EngineConfig)
    assert (engine.model, engine.devices, engine.page_size, engine.kv_cache_memory_bytes) == ("/m", "cpu", 256, 64 << 20)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len) == (4, 300, 1000)
    assert (engine.replica_id, engine.num_threads, engine.enable_prefix_caching) == ("r1", 2, True)
    assert (engine.enable_peer_copy, engine.redis_url, engine.disk_cache_dir) == (True, "redis://r:1/0", "/d")
    assert engine.disk_cache_budget_bytes == 8 << 30


def test_disk_tier_defaults_on_with_caching_and_off_without(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    on = ServeConfig(devices="cpu")
    assert on.enable_disk_cache is True
    assert on.engine_config("r").disk_cache_dir == str(tmp_path / "kv-pages")
    assert ServeConfig(devices="cpu", enable_disk_cache=False).engine_config("r").disk_cache_dir is None
    off = ServeConfig(devices="cpu", enable_prefix_caching=False)
    assert (off.enable_disk_cache, off.engine_config("r").disk_cache_dir) == (False, None)
    with pytest.raises(ValueError, match="--start-redis"):
        ServeConfig(devices="cpu", start_redis=True, redis_url="redis://h:1/0")
    with pytest.raises(ValueError, match="--enable-disk-cache"):
        ServeConfig(devices="cpu", enable_prefix_caching=False, enable_disk_cache=True)


def test_an_unknown_replica_transport_in_a_serve_config_is_refused():
    with pytest.raises(ValueError, match="--replica-transport must be one of grpc, ray"):
        ServeConfig.from_mapping({"devices": "cpu", "replica_transport": "zmq"})


def test_caching_off_turns_copy_off_by_default():
    config = parse("--devices", "cpu", "--no-enable-prefix-caching")
    assert (config.enable_prefix_caching, config.enable_dp_cross_replica_prefix_copy) == (False, False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("4096", 4096), ("64 mib", 64 << 20)],
)
def test_memory_sizes(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-page-size", "100"], "multiple of 128"),
        (["--kv-cache-page-size", "0"], "multiple of 128"),
        (["--data-parallel-degree", "0"], "--data-parallel-degree"),
        (["--devices", "gpu", "--data-parallel-degree", "64"], "GPUs"),
        (["--no-enable-prefix-caching", "--enable-dp-cross-replica-prefix-copy"], "--no-enable-prefix-caching"),
        (["--no-enable-prefix-caching", "--redis-url", "redis://h:1/0"], "--redis-url"),
        (["--no-enable-prefix-caching", "--disk-cache-dir", "/tmp/x"], "--disk-cache-dir"),
        (["--redis-url", "http://h"], "redis://"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--port", "70000"], "--port"),
        (["--num-cpus-per-replica", "0"], "--num-cpus-per-replica"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_invalid_combinations_are_one_line_and_status_2(flags, message, capsys):
    devices = [] if "--devices" in flags else ["--devices", "cpu"]
    status = cli.main(["serve", *devices, *flags])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert err.startswith("prefixserve serve: error: ")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "flags",
    [["--kv-cache-memory", "lots"], ["--dtype", "float16"], ["--replica-transport", "zmq"], ["--devices", "tpu"],
     ["--port", "x"], ["--bogus"]],
)
def test_bad_flag_values_exit_2_with_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("prefixserve") and " error: " in err


def test_missing_model_fails_before_ray(capsys, tmp_path):
    status = cli.main(["serve", "--devices", "cpu", "--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert status == 2 and "no such file or folder" in err and err.count("\n") == 1


def test_serve_help_documents_every_flag():
    text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ["--model", "--devices", "--data-parallel-degree", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--kv-cache-page-size", "--enable-dp-cross-replica-prefix-copy",
                 "--no-enable-dp-cross-replica-prefix-copy", "--kv-cache-memory", "--dtype", "--max-num-seqs",
                 "--max-model-len", "--max-num-batched-tokens", "--host", "--port", "--api-key", "--redis-url",
                 "--disk-cache-dir", "--ray-address", "--log-level", "--served-model-name",
                 "--num-cpus-per-replica"]:
        assert flag in text, flag


def test_from_mapping_accepts_flag_spellings():
    config = ServeConfig.from_mapping({"model": "/m", "devices": "cpu", "data-parallel-degree": 2,
                                       "kv_cache_page_size": 256, "kv_cache_memory": "1GiB"})
    assert (config.data_parallel_degree, config.page_size, config.kv_cache_memory) == (2, 256, 1 << 30)
    assert config.ray_address == "auto"
    with pytest.raises(ValueError, match="unknown prefixserve setting 'modle'"):
        ServeConfig.from_mapping({"modle": "/m"})


def test_python_dash_m_cluster_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "cluster", "serve", "--devices", "cpu", "--kv-cache-page-size",
                             "64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "prefixserve serve: error: --kv-cache-page-size must be a positive multiple of 128 tokens, got 64; "
        "use 128, 256, ..."
    ]


def test_make_tiny_model_delegates(tmp_path, capsys):
    status = cli.main(["make-tiny-model", "--out", str(tmp_path / "m"), "--hidden-size", "32", "--num-layers", "1",
                       "--num-heads", "2", "--num-kv-heads", "1", "--vocab-size", "300"])
    assert status == 0
    assert (tmp_path / "m" / "config.json").exists()
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_build_app_wires_replicas_router_and_ingress():
    """The application graph, inspected without starting Ray."""
    from cluster.app import SERVE_LATENCY_ENV, app_builder, build_app

    app = build_app(ServeConfig(devices="cpu", data_parallel_degree=3, num_cpus_per_replica=0.5,
                                enable_dp_cross_replica_prefix_copy=False, served_model_name="m"))
    ingress = app._bound_deployment
    replicas = ingress.init_args[0]._bound_deployment
    serve_env = {"runtime_env": {"env_vars": SERVE_LATENCY_ENV}}
    assert (ingress.name, ingress.ray_actor_options) == ("OpenAIIngress", {"num_cpus": 0, **serve_env})
    assert (replicas.name, replicas.num_replicas, replicas.ray_actor_options) == (
        "PrefixServeReplica", 3, {"num_cpus": 0.5, **serve_env})
    assert replicas.max_ongoing_requests >= 64  # continuous batching needs many requests in one replica
    router = replicas._deployment_config.request_router_config
    assert router.request_router_class.endswith("PrefixAwareRequestRouter")
    assert router.request_router_kwargs["enable_peer_hint"] is False
    engine_config, served_model_name = replicas.init_args
    assert (engine_config.devices, served_model_name) == ("cpu", "m")

    built = app_builder({"devices": "cpu", "data-parallel-degree": 2, "num_cpus_per_replica": 0.25})
    assert built._bound_deployment.init_args[0]._bound_deployment.num_replicas == 2


def test_prefill_threads_default_to_the_machine_s_cpus_shared_out_and_can_be_set(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    one = parse("--devices", "cpu")  # Ray starts here: 7 CPUs (one left to the proxy), all 8 for long steps
    assert (one.num_threads_per_replica, one.num_prefill_threads) == (7, 8)
    assert (one.engine_config("r").num_threads, one.engine_config("r").num_prefill_threads) == (7, 8)
    two = parse("--devices", "cpu", "--data-parallel-degree", "2")
    assert (two.num_threads_per_replica, two.num_prefill_threads) == (3, 4)
    many = parse("--devices", "cpu", "--data-parallel-degree", "8")  # never fewer than the replica's own threads
    assert (many.num_threads_per_replica, many.num_prefill_threads) == (1, 1)
    cluster = parse("--devices", "cpu", "--ray-address", "auto")
    assert (cluster.num_threads_per_replica, cluster.num_prefill_threads) == (1, 1)  # a cluster: its own count
    explicit = parse("--devices", "cpu", "--num-cpus-per-replica", "1")  # an explicit reservation is kept to
    assert (explicit.num_threads_per_replica, explicit.num_prefill_threads) == (1, 1)
    assert parse("--devices", "cpu", "--num-prefill-threads", "3").engine_config("r").num_prefill_threads == 3
    with pytest.raises(ValueError, match="--num-prefill-threads"):
        ServeConfig(devices="cpu", num_prefill_threads=0)


def test_route_on_tier_contents_reaches_the_replicas_and_the_router():
    """By default on exactly when peer copy is off and a shared tier is on (then the tiers are the only way between
    replicas); the flag sets both halves either way: the replicas' tier reports and the router's pricing."""
    from cluster.app import request_router_config
    from cluster.cli import build_parser, config_from_args

    no_copy = "--no-enable-dp-cross-replica-prefix-copy"
    for argv, expected in (([], False), (["--route-on-tier-contents"], True),
                           ([no_copy], True),  # the disk tier is on by default
                           ([no_copy, "--no-enable-disk-cache"], False),  # no shared tier
                           ([no_copy, "--no-enable-disk-cache", "--redis-url", "redis://h:6379/0"], True),
                           ([no_copy, "--no-enable-disk-cache", "--start-redis"], True),
                           ([no_copy, "--no-route-on-tier-contents"], False),
                           (["--no-enable-prefix-caching"], False)):
        config = config_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))
        assert config.route_on_tier_contents is expected
        assert config.engine_config("r").route_on_tier_contents is expected
        assert request_router_config(config).request_router_kwargs["enable_tier_routing"] is expected


def test_the_router_counts_tokens_in_the_replicas_pages_and_steps():
    """The router's cost model and its prompt tails use the replicas' page size and step budget, not the defaults
    (before, a deployment with 256-token pages was priced, and its tails cut, as if its pages held 128)."""
    from cluster.app import request_router_config
    from cluster.cli import build_parser, config_from_args
    from router.policy import PolicyConfig

    default = request_router_config(config_from_args(build_parser().parse_args(["serve", "--model", "m"])))
    assert default.request_router_kwargs["page_size"] == 128
    argv = ["serve", "--model", "m", "--kv-cache-page-size", "256", "--max-num-batched-tokens", "4096"]
    kwargs = request_router_config(config_from_args(build_parser().parse_args(argv))).request_router_kwargs
    assert (kwargs["page_size"], kwargs["max_num_batched_tokens"]) == (256, 4096)
    assert PolicyConfig(**kwargs).page_size == 256  # what the router builds its policy from


def test_the_router_prices_evictions_by_the_replicas_eviction():
    """Replicas on the segmented LRU (the default) push out mostly pages nobody reused: the router's eviction weight
    is PolicyConfig's default; with --kv-cache-protected-fraction 0 (plain LRU) it is the plain-LRU weight."""
    from cluster.app import request_router_config
    from cluster.cli import build_parser, config_from_args
    from router.policy import PLAIN_LRU_EVICTION_WEIGHT, PolicyConfig

    def weight(*flags):
        config = config_from_args(build_parser().parse_args(["serve", "--model", "m", *flags]))
        return request_router_config(config).request_router_kwargs["eviction_weight"]

    assert weight() == PolicyConfig.eviction_weight == 0.5
    assert weight("--kv-cache-protected-fraction", "0") == PLAIN_LRU_EVICTION_WEIGHT == 1.0
