"""deploy/ray's files, validated offline: the app config example loads and documents the
defaults, the cluster file passes Ray's autoscaler schema, the GPU config is the example with
one GPU per service; a bad config is refused naming the key."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml
from conftest import REPO

jsonschema = pytest.importorskip("jsonschema")


def test_ray_config_example_loads_and_documents_the_defaults():
    from orchestrator.ray.config import RayAppConfig

    example = RayAppConfig.load(str(REPO / "deploy/ray/config.yaml"))
    default = RayAppConfig.from_dict({})
    # The example shows the defaults: what it spells out must equal what an empty file means.
    for group in ("target", "draft"):
        a, b = getattr(example, group), getattr(default, group)
        assert a.service_config() == b.service_config()
        assert (a.resources, a.replicas, a.num_gpus) == (b.resources, b.replicas, b.num_gpus)
    assert example.orchestrator == default.orchestrator
    assert example.http == default.http


def test_ray_cluster_yaml_passes_the_autoscaler_schema():
    import ray.autoscaler

    schema = json.loads((pathlib.Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((REPO / "deploy/ray/cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    types = cluster["available_node_types"]
    assert types["draft_gpu"]["resources"]["draft_node"] == 1
    assert types["target_gpu"]["resources"]["target_node"] == 1
    cluster["available_node_types"]["draft_gpu"]["resources"]["draft_node"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, schema)


def test_the_gpu_ray_config_is_the_example_with_one_gpu_per_service():
    """deploy/ray/config-gpu.yaml (for the README's GPU cluster) differs from the documented
    example only in asking each service actor for a GPU and running it on CUDA."""
    import dataclasses

    from orchestrator.ray.config import RayAppConfig

    cpu = RayAppConfig.load(str(REPO / "deploy/ray/config.yaml"))
    gpu = RayAppConfig.load(str(REPO / "deploy/ray/config-gpu.yaml"))
    for group in ("target", "draft"):
        a, b = getattr(cpu, group), getattr(gpu, group)
        assert (a.num_gpus, b.num_gpus) == (0, 1), group
        assert b.service_config().device == "cuda"
        assert dataclasses.replace(b.service_config(), device="auto") == a.service_config()
        assert (a.resources, a.replicas, a.bind_host) == (b.resources, b.replicas, b.bind_host)
    assert cpu.orchestrator == gpu.orchestrator and cpu.http == gpu.http


@pytest.mark.parametrize("data, says", [
    ({"target": {"replicas": 0}}, "target.replicas: Input should be greater than or equal to 1"),
    ({"target": {"modle": "x"}}, "target.modle: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"orchestrator": {"routing": "random"}}, "orchestrator.routing: must be one of"),
    ({"draft": {"service": {"port": 1}}}, "service may not set port"),
    ({"http": {"port": "eighty"}}, "http.port: Input should be a valid integer"),
    ({"orchestrator": {"tls": {"ca": "x", "pin": "y"}}}, "orchestrator.tls.pin: unknown key"),
    ({"target": {"service": {"cache_cap_mb": -1}}}, "cache_cap_mb"),
])
def test_a_bad_ray_config_is_refused_naming_the_key(data, says):
    from orchestrator.ray.config import RayAppConfig

    with pytest.raises(ValueError, match=re.escape(says)):
        RayAppConfig.from_dict(data)


def test_ray_config_draft_defaults_and_target_only():
    from orchestrator.ray.config import RayAppConfig

    default = RayAppConfig.from_dict({})
    assert (default.target.model, default.draft.model) == ("default", "default-draft")
    assert default.draft.resources == {"draft_node": 1}
    assert RayAppConfig.from_dict({"draft": None}).draft is None
    fixed = RayAppConfig.from_dict({"target": {"addresses": ["10.0.0.1:50051", "10.0.0.2:50051"]}})
    assert fixed.target.replicas == 2 and not fixed.target.uses_actors
    # what Serve hands each replica (to_dict) builds the same config again
    assert RayAppConfig.from_dict(default.to_dict()) == default
