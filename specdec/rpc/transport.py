"""gRPC transport: message-size and keepalive options, TLS / mutual TLS credentials, channels,
and binding a server's port. Used by the services and by the orchestrator's service clients.
"""

from __future__ import annotations

import pathlib

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple]:
    """Client side: message limits, and keepalive pings so a dead peer is noticed in ~40 s."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A service that went away (restarting) is tried again every 0.1-2 s, not after
        # gRPC's default backoff of up to 120 s: a restarted service is used as it serves.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple]:
    """Server side: message limits, and accept the clients' keepalive pings (the default
    policy answers pings more often than every 5 minutes with GOAWAY "too_many_pings")."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def server_credentials(cert: str, key: str, client_ca: str | None = None):
    """TLS server credentials; with ``client_ca`` clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None):
    """TLS channel credentials: ``ca`` to trust the server, ``cert``/``key`` for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def aio_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: dict | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to a service; ``tls`` = dict(ca=..., cert=..., key=..., server_name=...)."""
    options = channel_options(max_message_bytes)
    if tls:
        if tls.get("server_name"):
            options.append(("grpc.ssl_target_name_override", tls["server_name"]))
        creds = channel_credentials(tls.get("ca"), tls.get("cert"), tls.get("key"))
        return grpc.aio.secure_channel(address, creds, options=options)
    return grpc.aio.insecure_channel(address, options=options)


def bind(server: grpc.aio.Server, host: str, port: int, config=None) -> int:
    """Bind host:port (0 = any free port), with TLS when the config has a certificate."""
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if config is not None and getattr(config, "tls_cert", None):
        creds = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"could not bind {address}")
    return bound


