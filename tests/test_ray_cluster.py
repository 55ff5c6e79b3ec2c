"""The Ray app on a simulated 3-node cluster (a head, a ``draft_node`` node, a ``target_node``
node, all on 127.0.0.1): actor placement by custom resources, and generations through the
Ray Serve app's HTTP front equal to target-only greedy decoding."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest
from conftest import free_port, hf_greedy, run

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from orchestrator.ray import app as ray_app  # noqa: E402
from orchestrator.ray.actors import start_services
from orchestrator.ray.config import RayAppConfig
from orchestrator.routing import rendezvous  # noqa: E402
from orchestrator.service_clients import DraftClient, TargetClient  # noqa: E402

PROMPTS = [[1, 520, 3300, 12, 99, 7], list(range(2000, 2030)), [5, 6, 7, 5, 6, 7, 5, 6]]
NODE = dict(node_ip_address="127.0.0.1", object_store_memory=80 * 1024 * 1024)


def app_config(target: str, draft: str, http_port: int, replicas: int = 2, **extra) -> dict:
    service = dict(calibrate=False, batch_wait_ms=0.0, device="cpu")
    group = dict(replicas=replicas, bind_host="127.0.0.1", num_cpus=0.5, service=service)
    return dict(
        name=extra.pop("name", "specdec-test"),
        namespace="specdec-test",
        target=dict(group, model=target),
        draft=dict(group, model=draft),
        orchestrator=dict(replicas=1, ray_actor_options={"num_cpus": 0.5}, tokenizer=target),
        http=dict(host="127.0.0.1", port=http_port),
        **extra,
    )


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU, no custom resources) + a draft node + a target node; ray.init on it."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    c = Cluster(initialize_head=True, head_node_args=dict(NODE, num_cpus=1, include_dashboard=False))
    try:
        # Room for three services of each role: the tiny app's two and the real pair's one.
        draft_node = c.add_node(**NODE, num_cpus=2, resources={"draft_node": 3})
        target_node = c.add_node(**NODE, num_cpus=2, resources={"target_node": 3})
        ray.init(address=c.address)
        yield dict(cluster=c, draft=draft_node.node_id, target=target_node.node_id,
                   head=c.head_node.node_id)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()  # kills the nodes' processes by process id


@pytest.fixture(scope="module")
def deployed(cluster, tiny_models):
    cfg = RayAppConfig.from_dict(
        app_config(tiny_models["target"], tiny_models["draft"], free_port()))
    infos = start_services(cfg, timeout_s=300)
    url = ray_app.deploy(cfg)
    yield dict(cfg=cfg, infos=infos, url=url)
    ray_app.undeploy(cfg)


def post(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def service_calls(address: str, role: str) -> int:
    async def calls() -> int:
        client = (TargetClient if role == "target" else DraftClient)(address)
        try:
            return int((await client.stats()).calls)
        finally:
            await client.close()

    return run(calls())


def test_actors_land_on_the_nodes_with_their_resources(cluster, deployed):
    infos = deployed["infos"]
    assert sorted(i["role"] for i in infos) == ["draft", "draft", "target", "target"]
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    for info in infos:
        assert info["ready"] and info["address"].startswith("127.0.0.1:")
        expected = cluster[info["role"]]
        assert info["node_id"] == expected
        assert nodes[info["node_id"]]["Resources"].get(f"{info['role']}_node") == 3
    assert cluster["draft"] != cluster["target"] != cluster["head"] != cluster["draft"]
    assert len({i["address"] for i in infos}) == 4


def test_generation_through_serve_equals_target_only(tiny_models, deployed):
    url = deployed["url"]
    for prompt in PROMPTS:
        ref = hf_greedy(tiny_models["target"], prompt, 24)
        for mode in ("pipelined", "spec"):
            out = post(url, dict(prompt_ids=prompt, max_new_tokens=24, mode=mode, k=3))
            assert out["token_ids"] == ref[: len(out["token_ids"])]
            assert len(out["token_ids"]) == 24 or out["finish_reason"] == "stop"
            assert out["mode"] == mode and out["draft_tokens"] > 0


def test_a_session_sticks_to_one_pair_for_all_its_rounds(tiny_models, deployed):
    url = deployed["url"]
    pairs = httpx.get(f"{url}/pairs", timeout=30).json()
    assert len(pairs) == 2
    labels = [p["pair"] for p in pairs]
    # Sequential requests meet two idle pairs: the session key's rendezvous hash decides.
    keys = [f"user-{i}" for i in range(12)]
    chosen = {rendezvous(k, 2) for k in keys}
    assert chosen == {0, 1}, "the keys should spread over both pairs"
    for key in keys[:4]:
        expected = labels[rendezvous(key, 2)]
        other = labels[1 - rendezvous(key, 2)]
        addrs = {pair: dict(part.split("=") for part in pair.split()) for pair in labels}
        before = {r: service_calls(addrs[other][r], r) for r in ("target", "draft")}
        mine_before = service_calls(addrs[expected]["target"], "target")
        out = post(url, dict(prompt_ids=PROMPTS[0], max_new_tokens=16, mode="spec", k=2,
                             session=key))
        assert out["pair"] == expected
        assert out["token_ids"] == hf_greedy(tiny_models["target"], PROMPTS[0], 16)[
            : len(out["token_ids"])]
        # Every round ran on the chosen pair: the other pair's services saw no call.
        assert {r: service_calls(addrs[other][r], r) for r in ("target", "draft")} == before
        assert service_calls(addrs[expected]["target"], "target") >= mine_before + out["rounds"]


def test_concurrent_requests_all_equal_target_only(tiny_models, deployed):
    url = deployed["url"]
    served_before = [p["served"] for p in httpx.get(f"{url}/pairs", timeout=30).json()]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(
            lambda p: post(url, dict(prompt_ids=p, max_new_tokens=20, mode="pipelined")),
            PROMPTS + PROMPTS[:1]))
    for prompt, out in zip(PROMPTS + PROMPTS[:1], outs):
        assert out["token_ids"] == hf_greedy(tiny_models["target"], prompt, 20)[
            : len(out["token_ids"])]
    served = [p["served"] for p in httpx.get(f"{url}/pairs", timeout=30).json()]
    assert sum(served) - sum(served_before) == 4


def test_openai_completions_through_serve(deployed):
    """The replica serves the OpenAI-compatible front over the same pairs."""
    url = deployed["url"]
    prompt = "The sea is"
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="specdec", prompt=prompt, max_tokens=16, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    native = post(url, dict(prompt=prompt, max_new_tokens=16, mode="target-only"))
    assert body["choices"][0]["text"] == native["text"]
    assert body["usage"]["completion_tokens"] == native["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == native["prompt_tokens"]
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["specdec"]


def test_bad_requests_get_400(deployed):
    url = deployed["url"]
    r = httpx.post(f"{url}/generate", json=dict(prompt_ids=[1, 2], max_new_tokens=0), timeout=30)
    assert r.status_code == 400 and "max_new_tokens" in r.text
    r = httpx.post(f"{url}/generate", json=dict(max_new_tokens=4), timeout=30)
    assert r.status_code == 400 and "prompt" in r.text
    r = httpx.post(f"{url}/generate", json=dict(prompt_ids=[1], mode="warp"), timeout=30)
    assert r.status_code == 400 and "mode" in r.text


@pytest.mark.real
def test_real_default_pair_through_serve(cluster, deployed):
    """The default pair (SmolLM2-135M-Instruct + the shipped draft) as actors, chat prompt."""
    # Same HTTP proxy (Serve has one per cluster), another app under another route prefix.
    port = deployed["cfg"].http.port
    cfg = RayAppConfig.from_dict(
        app_config("default", "default-draft", port, replicas=1, name="specdec-real",
                   route_prefix="/real"))
    try:
        start_services(cfg, timeout_s=600)
        url = ray_app.deploy(cfg)
        # a fixed k: adaptive k may choose not to draft on a busy machine's live costs
        out = post(url, dict(prompt="What is the capital of France?", chat=True,
                             max_new_tokens=32, mode="pipelined", k=3))
        ref = post(url, dict(prompt="What is the capital of France?", chat=True,
                             max_new_tokens=32, mode="target-only"))
        assert out["token_ids"] == ref["token_ids"]
        assert out["accepted_tokens"] > 0
        assert "Paris" in out["text"]
    finally:
        ray_app.undeploy(cfg)
