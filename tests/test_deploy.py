"""The deployment files, validated offline: the kustomize trees render; core kinds pass
`kubernetes-validate --strict`; RayService passes KubeRay's v1.7.0 CRD schema; serveConfigV2
passes Ray's own ServeDeploySchema and builds the app; the services' image needs no extras
(deploy/ray's files: test_deploy_ray.py). A deliberately broken manifest fails each check."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

jsonschema = pytest.importorskip("jsonschema")

K8S = REPO / "deploy" / "k8s"
TREES = {"default": K8S, "gpu": K8S / "overlays/gpu", "cpu": K8S / "overlays/cpu",
         "tls": K8S / "overlays/tls"}
KUBE_VERSION = "1.33.0"
RAYSERVICE_SCHEMA = REPO / "tests" / "data" / "kuberay-v1.7.0-rayservice-v1.json.gz"
CORE_KINDS = {"ConfigMap", "Service", "Deployment", "PersistentVolumeClaim"}


def kustomize_command() -> list[str]:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    pytest.skip("neither kustomize nor kubectl is installed: cannot render deploy/k8s")


def render(path: pathlib.Path) -> list[dict]:
    out = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in TREES.items()}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in by_kind(docs, kind) if d["metadata"]["name"] == name)


# --------------------------------------------------------------------------- core kinds


def kubernetes_validate(docs: list[dict], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    exe = pathlib.Path(sys.executable).parent / "kubernetes-validate"
    if not exe.exists():
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[test]')")
    return subprocess.run([str(exe), "-k", KUBE_VERSION, "--strict", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tree", list(TREES))
def test_core_kinds_pass_kubernetes_validate_strict(rendered, tree, tmp_path):
    core = [d for d in rendered[tree] if d["kind"] in CORE_KINDS]
    assert {d["kind"] for d in core} == {"ConfigMap", "Service", "Deployment"}
    out = kubernetes_validate(core, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed for resource") == len(core), out.stdout


def test_a_broken_core_manifest_fails_kubernetes_validate(rendered, tmp_path):
    deployment = copy.deepcopy(named(rendered["default"], "Deployment", "specdec-target"))
    deployment["spec"]["replicas"] = "two"
    assert kubernetes_validate([deployment], tmp_path).returncode != 0
    deployment = copy.deepcopy(named(rendered["default"], "Deployment", "specdec-target"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {}
    out = kubernetes_validate([deployment], tmp_path)  # --strict: unknown fields fail
    assert out.returncode != 0, out.stdout


# --------------------------------------------------------------------------- what the trees say


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("tree", ["default", "gpu", "tls"])
def test_gpu_trees_request_gpus_on_their_pools(rendered, tree):
    docs = rendered[tree]
    for role, pool in (("draft", "small-gpu"), ("target", "large-gpu")):
        d = named(docs, "Deployment", f"specdec-{role}")
        c = container(d)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "memory" in c["resources"]["limits"]
        pod = d["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"specdec.io/pool": pool}
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    groups = {g["groupName"]: g for g in
              named(docs, "RayService", "specdec")["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["draft-gpu"]["template"]["spec"]["nodeSelector"] == {"specdec.io/pool": "small-gpu"}
    assert groups["target-gpu"]["template"]["spec"]["nodeSelector"] == {"specdec.io/pool": "large-gpu"}


def test_cpu_overlay_has_no_gpu_anywhere(rendered):
    docs = rendered["cpu"]
    assert "gpu" not in json.dumps([d for d in docs if d["kind"] != "RayService"]).lower()
    cluster = named(docs, "RayService", "specdec")["spec"]["rayClusterConfig"]
    assert "nvidia.com/gpu" not in json.dumps(cluster)
    for role in ("draft", "target"):
        pod = named(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod


@pytest.mark.parametrize("tree", ["default", "cpu"])
def test_services_expose_grpc_and_probe_the_health_service(rendered, tree):
    docs = rendered[tree]
    models = named(docs, "ConfigMap", "specdec-models")["data"]
    for role in ("draft", "target"):
        d = named(docs, "Deployment", f"specdec-{role}")
        c = container(d)
        (port,) = c["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port["containerPort"]  # native gRPC probes
        svc = named(docs, "Service", f"specdec-{role}")
        assert svc["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["ports"][0]["targetPort"] == port["name"]
        assert svc["spec"]["ports"][0]["appProtocol"] == "grpc"
        # The model comes from the ConfigMap, through the container's environment.
        assert {"configMapRef": {"name": "specdec-models"}} in c["envFrom"]
        assert f"$({role.upper()}_MODEL)" in c["args"]
        assert f"serve-{role}" in c["args"]
    assert set(models) == {"TARGET_MODEL", "DRAFT_MODEL"}


def test_tls_overlay_mounts_secrets_and_turns_on_mutual_tls(rendered):
    docs = rendered["tls"]
    for role in ("draft", "target"):
        d = named(docs, "Deployment", f"specdec-{role}")
        c = container(d)
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "specdec-server-tls"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        for flag in ("--tls-cert", "--tls-key", "--tls-client-ca"):
            arg = next(a for a in c["args"] if a.startswith(flag + "="))
            assert arg.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    cluster = named(docs, "RayService", "specdec")["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]):
        pod = group["template"]["spec"]
        assert pod["volumes"][0]["secret"]["secretName"] == "specdec-client-tls"
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["SPECDEC_TLS_CA"].startswith(pod["containers"][0]["volumeMounts"][0]["mountPath"])


def test_models_pvc_component_renders_a_claim(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays/cpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components/models-pvc", tmp_path)],
    }))
    docs = render(tmp_path)
    assert named(docs, "PersistentVolumeClaim", "specdec-models")
    for role in ("draft", "target"):
        volumes = named(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]["volumes"]
        models = next(v for v in volumes if v["name"] == "models")
        assert models["persistentVolumeClaim"]["claimName"] == "specdec-models"


def test_k8s_tls_overlay_flags_parse_into_a_mutual_tls_config(monkeypatch):
    """The rendered Deployments' args, run through specdec's own parser, give a ServiceConfig
    with mutual TLS; the RayService pods' environment gives the replicas full client TLS."""
    from orchestrator.cli import build_parser
    from orchestrator.ray.app import _env_tls
    from specdec.rpc import service_main

    docs = render(K8S / "overlays/tls")
    models = named(docs, "ConfigMap", "specdec-models")["data"]
    for role in ("draft", "target"):
        c = container(named(docs, "Deployment", f"specdec-{role}"))
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        parsed = build_parser().parse_args(_substitute(c["args"], models))
        config = service_main.service_config_from_args(parsed, role)
        assert config.tls_client_ca and config.tls_cert and config.tls_key
        for path in (config.tls_cert, config.tls_key, config.tls_client_ca):
            assert os.path.dirname(path) in mounts
    cluster = named(docs, "RayService", "specdec")["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"][:1]):
        (c,) = group["template"]["spec"]["containers"][:1]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for name in ("CA", "CERT", "KEY", "SERVER_NAME"):
            monkeypatch.delenv(f"SPECDEC_TLS_{name}", raising=False)
        for name, value in env.items():
            if name.startswith("SPECDEC_TLS_"):
                monkeypatch.setenv(name, value)
        tls = _env_tls()
        assert tls and tls["ca"] and tls["cert"] and tls["key"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {os.path.dirname(tls[k]) for k in ("ca", "cert", "key")} <= mounts


def _substitute(args: list[str], variables: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args."""
    out = []
    for a in args:
        for k, v in variables.items():
            a = a.replace(f"$({k})", v)
        out.append(a)
    return out


# --------------------------------------------------------------------------- KubeRay CRDs


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    """The openAPIV3Schema of a KubeRay kind's v1 version (tests/data, KubeRay v1.7.0)."""
    assert kind == "RayService", kind
    return json.loads(gzip.decompress(RAYSERVICE_SCHEMA.read_bytes()))


def to_json_schema(node):
    """A Kubernetes structural schema as JSON Schema: nullable, int-or-string, and unknown
    fields rejected where the API server would prune them (kubectl --validate=strict)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "nullable"}
    if "properties" in node and isinstance(node["properties"], dict):
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: dict, obj) -> None:
    """Fill schema defaults in place, as the API server does before it checks ``required``."""
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(schema["items"], item)


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str):
    return jsonschema.Draft4Validator(to_json_schema(crd_schema(kind)))


def crd_errors(doc: dict) -> list[str]:
    obj = copy.deepcopy(doc)
    apply_defaults(crd_schema(doc["kind"]), obj)
    validator = crd_validator(doc["kind"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("tree", list(TREES))
def test_rayservice_passes_the_kuberay_crd_schema(rendered, tree):
    (rs,) = by_kind(rendered[tree], "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    assert crd_errors(rs) == []


def test_head_and_worker_groups_declare_the_custom_resources(rendered):
    cluster = named(rendered["default"], "RayService", "specdec")["spec"]["rayClusterConfig"]

    def declared(group: dict) -> dict:
        return json.loads(json.loads(group["rayStartParams"]["resources"]))

    assert declared(cluster["headGroupSpec"]) == {"orchestrator_node": 1}
    groups = {g["groupName"]: declared(g) for g in cluster["workerGroupSpecs"]}
    assert groups == {"orchestrator": {"orchestrator_node": 1}, "draft-gpu": {"draft_node": 1},
                      "target-gpu": {"target_node": 1}}


def test_a_broken_rayservice_fails_the_crd_schema(rendered):
    good = named(rendered["default"], "RayService", "specdec")
    broken = copy.deepcopy(good)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert any("replicas" in e for e in crd_errors(broken))
    broken = copy.deepcopy(good)
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in crd_errors(broken))
    broken = copy.deepcopy(good)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # a typo
    assert any("rayStartParam" in e for e in crd_errors(broken))
    broken = copy.deepcopy(good)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "ports"][0]["containerPort"] = "http"
    assert any("containerPort" in e for e in crd_errors(broken))


# --------------------------------------------------------------------------- serveConfigV2


def serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(named(docs, "RayService", "specdec")["spec"]["serveConfigV2"])


def serve_errors(config: dict) -> list[str]:
    """Ray's own schema, then specdec's: the app's args and the deployment names."""
    from ray.serve.schema import ServeDeploySchema

    from orchestrator.ray import app as ray_app
    from orchestrator.ray.config import RayAppConfig

    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        return [str(exc)]
    errors = []
    for app in schema.applications:
        if app.import_path != "orchestrator.ray.app:app":
            errors.append(f"unexpected import_path {app.import_path}")
            continue
        try:
            RayAppConfig.from_dict(app.args)
        except ValueError as exc:
            errors.append(str(exc))
        errors += [f"no deployment named {d.name}" for d in app.deployments
                   if d.name != ray_app.INGRESS_NAME]
    return errors


@pytest.mark.parametrize("tree", list(TREES))
def test_serve_config_passes_ray_serve_schema(rendered, tree):
    assert serve_errors(serve_config(rendered[tree])) == []


def test_serve_app_points_at_the_draft_and_target_services(rendered):
    from orchestrator.ray import app as ray_app
    from orchestrator.ray.config import RayAppConfig

    docs = rendered["default"]
    (app,) = serve_config(docs)["applications"]
    cfg = RayAppConfig.from_dict(app["args"])
    for group in (cfg.target, cfg.draft):
        assert not group.uses_actors
        (address,) = group.addresses
        host, port = address.rsplit(":", 1)
        svc = named(docs, "Service", host)
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == group.role
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    # The builder Serve calls: an Application over the configured addresses (no actors).
    assert ray_app.app(app["args"]) is not None


def test_a_broken_serve_config_fails(rendered):
    good = serve_config(rendered["default"])
    broken = copy.deepcopy(good)
    broken["applications"][0]["deployments"][0]["num_replicas"] = -1
    assert serve_errors(broken)
    broken = copy.deepcopy(good)
    broken["applications"].append(copy.deepcopy(broken["applications"][0]))  # same name twice
    assert serve_errors(broken)
    broken = copy.deepcopy(good)
    broken["http_options"]["port"] = "eighty"
    assert serve_errors(broken)
    broken = copy.deepcopy(good)
    broken["applications"][0]["args"]["draft"]["adresses"] = ["x:1"]  # a typo
    assert any("adresses" in e for e in serve_errors(broken))
    broken = copy.deepcopy(good)
    broken["applications"][0]["deployments"][0]["name"] = "Ingress"
    assert serve_errors(broken) == ["no deployment named Ingress"]


# --------------------------------------------------------------------------- images


def test_the_services_image_carries_no_extras_and_the_services_need_none():
    """Dockerfile.services installs the runtime requirements only, the k8s services run that
    image, and the CLI and both services import with Ray, plotting and the test tools absent."""
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        import requirements
    finally:
        sys.path.pop(0)
    runtime = requirements.requirements([], REPO / "pyproject.toml")
    names = {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0] for r in runtime}
    assert not names & {"ray", "pytest", "matplotlib", "openai", "lm-eval", "grpcio-tools"}
    assert "ray[serve]>=2.40" in requirements.requirements(["ray"], REPO / "pyproject.toml")
    with pytest.raises(SystemExit, match="unknown extra"):
        requirements.requirements(["rays"], REPO / "pyproject.toml")
    docker = (REPO / "deploy/docker/Dockerfile.services").read_text()
    install = docker[docker.index("\nRUN "):docker.index("\nUSER")]
    assert "python deploy/requirements.py >" in install and "[" not in install  # no extra
    docs = render(K8S)
    for role in ("draft", "target"):
        assert container(named(docs, "Deployment", f"specdec-{role}"))["image"].startswith(
            "specdec-services:")
    absent = ("ray", "matplotlib", "pytest", "openai", "lm_eval", "hypothesis", "grpc_tools")
    code = ("import sys\n"
            f"for m in {absent!r}: sys.modules[m] = None  # importing any of them fails\n"
            "import draft_service.server, target_service.server\n"
            "import specdec.models.loading, specdec.serving.runtime\n"
            "from orchestrator.cli import main\n"
            "main(['serve-target', '--help'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--model" in out.stdout
