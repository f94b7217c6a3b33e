"""Deployment files: the `ray up` YAML passes Ray's own validator; the Serve config YAML deploys and serves.

The Serve config is applied the way ``serve deploy`` / ``serve run CONFIG`` apply it (a ServeDeploySchema handed to
the controller, which builds the app from ``import_path`` + ``args`` in a Ray task), on the session's local Ray, with
the model swapped for a tiny one and its own route prefix.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import httpx
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def load_yaml(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import validate_config

    config = load_yaml("cluster.yaml")
    validate_config(copy.deepcopy(config))
    setup = "\n".join(config["setup_commands"])
    assert setup.index("torch==") < setup.index("prefixserve"), "torch must be installed (pinned) first"
    head = "\n".join(config["head_setup_commands"])
    assert "redis-server" in head and "volatile-lru" in head and "--maxmemory" in head


def test_redis_conf_is_a_bounded_lru_cache():
    lines = {line.split()[0]: line.split()[1:] for line in (DEPLOY / "redis.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    assert lines["maxmemory-policy"] == ["volatile-lru"]  # retained pages (no expiry) are not evicted
    assert lines["maxmemory"] and lines["appendonly"] == ["no"]
    assert lines["port"] != ["6379"], "6379 is Ray's GCS port on the head"


@pytest.mark.parametrize("name", ["serve.yaml", "serve-gpu.yaml"])
def test_serve_configs_parse(name):
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ServeConfig

    schema = ServeDeploySchema.model_validate(load_yaml(name))
    for app in schema.applications:
        assert app.import_path == "cluster.app:app_builder"
        args = dict(app.args)
        if args.get("devices") == "gpu":  # the GPU count is the cluster's, checked when the app is built there
            args["ray_address"] = "auto"
        ServeConfig.from_mapping(args)


@pytest.mark.ray
def test_serve_config_deploys_and_serves(ray_session, serve_http_port, tiny_llama_dir):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    raw = load_yaml("serve.yaml")
    app = raw["applications"][0]
    app["name"] = "deploy-check"
    app["route_prefix"] = "/deploy-check"
    app["args"].update(model=tiny_llama_dir, served_model_name="tiny", data_parallel_degree=1,
                       num_cpus_per_replica=0.5, kv_cache_memory="32MiB", max_model_len=1024, dtype="float32",
                       enforce_eager=True)  # the file as shipped, its forward eager: a compile costs CI tens of seconds
    raw.pop("http_options", None)  # the session's Serve is already listening on its own port
    schema = ServeDeploySchema.model_validate(raw)
    client = _get_global_client()
    client.deploy_apps(schema, _blocking=True)
    try:
        url = f"http://127.0.0.1:{serve_http_port}/deploy-check/v1/completions"
        deadline = time.monotonic() + 60
        while True:
            response = httpx.post(url, json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 4,
                                             "temperature": 0}, timeout=30)
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        serve.delete("deploy-check")
