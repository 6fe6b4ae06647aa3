"""TLS on both servers from server.tls_cert_file / tls_key_file, with a self-signed certificate.

The certificate is made with the ``cryptography`` package when installed, else
with the ``openssl`` command; without either the test is skipped.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_testutil import server_config

from specserve.errors import ConfigError
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc


def _with_cryptography(cert: Path, key: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _with_openssl(cert: Path, key: Path) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip


@pytest.fixture
def self_signed(tmp_path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        _with_cryptography(cert, key)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available to make a certificate")
        _with_openssl(cert, key)
    return cert, key


def test_tls_on_grpc_and_http(self_signed):
    cert, key = self_signed
    handle = start_servers(server_config(tls_cert_file=str(cert), tls_key_file=str(key)), FakeEngine())
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{handle.grpc_port}", creds) as channel:
            resp = pb_grpc.SpecServeStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=3))
            )
            assert resp.finish_reason == pb.FINISH_REASON_LENGTH
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{handle.grpc_port}") as plain:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                pb_grpc.SpecServeStub(plain).GetModelInfo(pb.GetModelInfoRequest(), timeout=2)

        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://localhost:{handle.http_port}/v1/models", context=ctx, timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "fake-model"
    finally:
        handle.stop()


def test_unreadable_certificate_is_a_config_error(tmp_path):
    engine = FakeEngine()
    cfg = server_config(tls_cert_file=str(tmp_path / "missing.pem"), tls_key_file=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match="server.tls_cert_file"):
        start_servers(cfg, engine)
    assert engine.shut_down


def test_port_in_use_is_a_config_error():
    first = start_servers(server_config(), FakeEngine())
    try:
        with pytest.raises(ConfigError, match="server.http_port"):
            start_servers(server_config(http_port=first.http_port), FakeEngine())
        with pytest.raises(ConfigError, match="server.grpc_port"):
            start_servers(server_config(grpc_port=first.grpc_port), FakeEngine())
    finally:
        first.stop()
