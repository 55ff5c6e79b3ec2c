"""TLS and mutual TLS on the gRPC channels, HTTPS and the API key on the HTTP front, no secret in
any log: real services (in-process and as `specdec serve-*` processes) with throwaway
certificates from tests/certs.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from certs import CA
from conftest import REPO, ServiceThread, hf_greedy, run, stop_process, wait_for_port_file

from orchestrator.generation import GenerationRequest
from orchestrator.local import ServiceProcess, service_args
from orchestrator.pair import close, connect
from orchestrator.service_clients import ServiceError
from specdec.models.hub import load_tokenizer
from specdec.rpc import transport
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

PROMPT = list(range(2000, 2030))
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog and then"
MAX_NEW = 30
API_KEY = "sk-specdec-test-3f9a7c1e5b"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Our CA with a loopback server certificate and a client certificate; a second CA (not
    trusted by anyone) with its own client and server certificates."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA(root / "ours"), CA(root / "other", name="someone else's CA")
    return dict(ca=ca, server=ca.server(), client=ca.client(), https=ca.server("https"),
                other_ca=other, other_client=other.client(), other_server=other.server())


def client_tls(pki, cert=True, ca=None, **extra) -> dict:
    tls = dict(ca=ca or pki["ca"].cert_path, **extra)
    if cert:
        tls.update(cert=pki["client"].cert, key=pki["client"].key)
    return tls


@pytest.fixture(scope="module")
def tls_pair(tiny_models, pki):
    """Server-authenticated TLS only (any client may connect), in-process services."""
    server = dict(tls_cert=pki["server"].cert, tls_key=pki["server"].key)
    target = ServiceThread("target", tiny_models["target"], **server)
    draft = ServiceThread("draft", tiny_models["near_draft"], target=tiny_models["target"],
                          **server)
    yield target, draft
    target.stop()
    draft.stop()


@pytest.fixture(scope="module")
def mtls_pair(tiny_models, pki, tmp_path_factory):
    """Mutual TLS: `specdec serve-target/serve-draft` processes started with the --tls-* flags,
    logging at DEBUG into files (checked for secrets)."""
    logs = tmp_path_factory.mktemp("mtls-logs")
    flags = ["--no-calibrate", "--log-level", "DEBUG", "--tls-cert", pki["server"].cert,
             "--tls-key", pki["server"].key, "--tls-client-ca", pki["ca"].cert_path]
    target = ServiceProcess("target", service_args(tiny_models["target"], 1, flags),
                            log_path=str(logs / "target.log"))
    draft = ServiceProcess(
        "draft", service_args(tiny_models["near_draft"], 1,
                              [*flags, "--target", tiny_models["target"]]),
        log_path=str(logs / "draft.log"))
    try:
        target.wait_port(300)
        draft.wait_port(300)
        yield target, draft
    finally:
        target.stop()
        draft.stop()


async def _generate(target_addr, draft_addr, tls, mode="pipelined", prompt=PROMPT):
    orch = await connect(target_addr, draft_addr, tls=tls, ready_timeout_s=60)
    try:
        result = await orch.generate(GenerationRequest(prompt, MAX_NEW, mode=mode, k=3))
        healthy = [await orch.target.healthy(), await orch.draft.healthy()]
        return result, healthy
    finally:
        await close(orch)


def refused(address: str, tls: dict | None, timeout_s: float = 3.0) -> ServiceError:
    """The ServiceError a connection attempt ends with (it must not succeed)."""
    with pytest.raises(ServiceError) as info:
        run(connect(address, None, tls=tls, ready_timeout_s=timeout_s))
    return info.value


# --------------------------------------------------------------------------- gRPC channels


def test_tls_generation_equals_transformers(tls_pair, tiny_models, pki):
    target, draft = tls_pair
    reference = hf_greedy(tiny_models["target"], PROMPT, MAX_NEW)
    result, healthy = run(_generate(target.address, draft.address, client_tls(pki, cert=False)))
    assert result.token_ids == reference
    assert result.stats.accepted_tokens > 0  # the draft really took part
    assert healthy == [True, True]  # the health check runs over the TLS channel too
    # the certificate names localhost as well: the name can be checked instead of the IP
    result, _ = run(_generate(target.address, draft.address,
                              client_tls(pki, cert=False, server_name="localhost"), mode="spec"))
    assert result.token_ids == reference


def test_tls_server_refuses_plaintext_and_clients_refuse_untrusted_servers(tls_pair, pki):
    target, _ = tls_pair
    assert refused(target.address, None).code == grpc.StatusCode.UNAVAILABLE
    # a server whose certificate our CA did not sign, or one for another name: the handshake
    # fails, and the connection attempt with it at once rather than after its 120 s
    for tls, why in ((dict(ca=pki["other_ca"].cert_path), "handshake failed"),
                     (client_tls(pki, cert=False, server_name="specdec-other"),
                      "hostname verification")):
        started = time.monotonic()
        err = refused(target.address, tls, timeout_s=120)
        assert err.code == grpc.StatusCode.UNAVAILABLE and why in err.details.lower(), err
        assert time.monotonic() - started < 60


def test_mutual_tls_generation_equals_transformers(mtls_pair, tiny_models, pki):
    target, draft = mtls_pair
    reference = hf_greedy(tiny_models["target"], PROMPT, MAX_NEW)
    for mode in ("spec", "pipelined"):
        result, healthy = run(_generate(target.address, draft.address, client_tls(pki), mode))
        assert result.token_ids == reference, mode
        assert healthy == [True, True]


@pytest.mark.parametrize("who", ["no client certificate", "another CA's certificate",
                                 "plaintext"])
def test_mutual_tls_refuses_clients_without_our_certificate(mtls_pair, pki, who):
    target, draft = mtls_pair
    tls = {"no client certificate": client_tls(pki, cert=False),
           "another CA's certificate": client_tls(pki) | dict(cert=pki["other_client"].cert,
                                                              key=pki["other_client"].key),
           "plaintext": None}[who]
    for service in (target, draft):
        assert refused(service.address, tls).code == grpc.StatusCode.UNAVAILABLE

    async def raw_calls():
        """A stub call and the health check on such a channel: refused, never answered."""
        channel = transport.aio_channel(target.address, tls=tls)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.TargetServiceStub(channel).GetStats(pb.StatsRequest(), timeout=3)
            return info.value.code()
        finally:
            await channel.close()

    assert run(raw_calls()) == grpc.StatusCode.UNAVAILABLE
    # the service is fine and still serves a client holding our certificate
    result, _ = run(_generate(target.address, draft.address, client_tls(pki), "spec"))
    assert len(result.token_ids) == MAX_NEW


def test_ray_app_config_and_environment_pass_tls_to_the_channels(mtls_pair, tiny_models, pki,
                                                               monkeypatch):
    from orchestrator.ray.app import RayAppConfig, connect_pairs

    target, draft = mtls_pair

    def config(tls):
        return RayAppConfig.from_dict({
            "target": {"model": tiny_models["target"], "addresses": [target.address]},
            "draft": {"model": tiny_models["near_draft"], "addresses": [draft.address]},
            "orchestrator": {"tls": tls, "ready_timeout_s": 3.0,
                             "tokenizer": tiny_models["target"]}})

    async def pairs_up(cfg) -> int:
        router = await connect_pairs(cfg)
        try:
            result = await router.pairs[0].generate(GenerationRequest(PROMPT, 8, mode="spec"))
            return len(result.token_ids)
        finally:
            for orch in router.pairs:
                await close(orch)

    for name in ("CA", "CERT", "KEY", "SERVER_NAME"):
        monkeypatch.delenv(f"SPECDEC_TLS_{name}", raising=False)
    with pytest.raises(ServiceError):  # no TLS configured: the services refuse the replica
        run(pairs_up(config(None)))
    assert run(pairs_up(config(client_tls(pki)))) == 8  # orchestrator.tls in the app config
    monkeypatch.setenv("SPECDEC_TLS_CA", pki["ca"].cert_path)  # what deploy/k8s mounts
    monkeypatch.setenv("SPECDEC_TLS_CERT", pki["client"].cert)
    monkeypatch.setenv("SPECDEC_TLS_KEY", pki["client"].key)
    assert run(pairs_up(config(None))) == 8


# --------------------------------------------------------------------------- command lines


def specdec(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_generate_cli_over_mutual_tls(mtls_pair, tiny_models, pki):
    target, draft = mtls_pair
    tok = load_tokenizer(tiny_models["target"])
    prompt_ids = tok(TEXT_PROMPT)["input_ids"]
    common = ["generate", TEXT_PROMPT, "--no-chat", "--json", "--max-new-tokens", "24",
              "--target", tiny_models["target"], "--target-addr", target.address,
              "--draft-addr", draft.address, "--mode", "spec", "--tls-ca", pki["ca"].cert_path,
              "--decode-on", "0"]  # tiny models: a call costs more than a pass (conftest)
    out = specdec(*common, "--tls-cert", pki["client"].cert, "--tls-key", pki["client"].key)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.splitlines()[-1])
    assert answer["token_ids"] == hf_greedy(tiny_models["target"], prompt_ids, 24)
    assert answer["draft_tokens"] > 0
    # half a client certificate is refused before anything is sent
    out = specdec(*common, "--tls-cert", pki["client"].cert)
    assert out.returncode != 0 and "--tls-cert and --tls-key" in out.stderr


def test_tls_flags_without_service_addresses_are_refused():
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as info:  # before any local service is started
        main(["generate", "hi", "--tls-ca", __file__, "--max-new-tokens", "2"])
    assert "--target-addr" in str(info.value.code)


def test_serve_https_api_key_and_no_secret_in_any_log(mtls_pair, tiny_models, pki,
                                                      tmp_path):
    target, draft = mtls_pair
    port_file, log_path = tmp_path / "port", tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0",
             "--port-file", str(port_file), "--log-level", "DEBUG", "--max-new-tokens", "16",
             "--target", tiny_models["target"], "--target-addr", target.address,
             "--draft-addr", draft.address, "--tls-ca", pki["ca"].cert_path,
             "--tls-cert", pki["client"].cert, "--tls-key", pki["client"].key,
             "--ssl-certfile", pki["https"].cert, "--ssl-keyfile", pki["https"].key],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "SPECDEC_API_KEY": API_KEY})  # the key never on a command line
    try:
        port = wait_for_port_file(proc, port_file, log_path, 300)
        base = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=pki["ca"].cert_path, timeout=120) as http:
            client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, http_client=http)
            stream = client.completions.create(
                model="specdec", prompt=TEXT_PROMPT, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tok = load_tokenizer(tiny_models["target"])
            reference = hf_greedy(tiny_models["target"], tok(TEXT_PROMPT)["input_ids"], 16)
            assert text == tok.decode(reference, skip_special_tokens=True)
            assert chunks[-1].usage.completion_tokens == len(reference)
            # a wrong key, and no key: 401 (and the wrong key is not logged either)
            wrong = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY[::-1], http_client=http,
                                  max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            assert http.get(base + "/v1/models").status_code == 401
            assert http.get(base + "/health").status_code == 200
        # a client that does not trust our CA refuses the server; plain HTTP gets no answer
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", verify=pki["other_ca"].cert_path)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        stop_process(proc)
    logs = {path.name: path.read_text(errors="replace")
            for path in (log_path, pathlib.Path(target.log_path), pathlib.Path(draft.log_path))}
    assert "request id=" in logs["serve.log"]  # the logs did capture the requests
    assert "ready" in logs["target.log"] and "ready" in logs["draft.log"]
    secrets = {"API key": API_KEY, "wrong API key": API_KEY[::-1]}
    for name in ("client", "server", "https"):
        body = pathlib.Path(pki[name].key).read_text().splitlines()[1:-1]
        secrets[f"{name} key"] = "".join(body)[:40]
        secrets[f"{name} key line"] = body[0]
    for log_name, text in logs.items():
        assert "PRIVATE KEY" not in text, log_name
        for what, secret in secrets.items():
            assert secret not in text, f"{what} found in {log_name}"
