"""The committed stubs in specserve/v1 are what protoc makes of protos/specserve/v1/specserve.proto."""

from __future__ import annotations

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2

from specserve.v1 import regenerate, specserve_pb2, specserve_pb2_grpc

HINT = "the stubs are stale: run `python -m specserve.v1.regenerate` and commit the result"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    return {p.name: p for p in regenerate.generate(out)}


def test_descriptor_matches_the_proto(tmp_path):
    """Independent of the grpcio-tools version: the schema itself must agree."""
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"--proto_path={regenerate.PROTO_ROOT}", f"--descriptor_set_out={out}",
                        regenerate.PROTO_FILE]) == 0  # fmt: skip
    [regenerated] = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    for message in regenerated.message_type:  # the Python generator leaves the default json_name out
        for f in message.field:
            f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(specserve_pb2.DESCRIPTOR.serialized_pb)
    assert committed == regenerated, HINT


def test_committed_files_are_byte_identical(fresh):
    tools = getattr(grpc_tools, "__version__", None)
    if tools is None:
        from grpc_tools import grpc_version

        tools = grpc_version.VERSION
    if tools != specserve_pb2_grpc.GRPC_GENERATED_VERSION:
        pytest.skip(f"grpcio-tools {tools} here, stubs made by {specserve_pb2_grpc.GRPC_GENERATED_VERSION}")
    for name, path in fresh.items():
        committed = (regenerate.PACKAGE_DIR / name).read_text()
        assert path.read_text() == committed, f"{name}: {HINT}"


def test_service_shape():
    service = specserve_pb2.DESCRIPTOR.services_by_name["SpecServe"]
    assert service.full_name == "specserve.v1.SpecServe"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {"Generate": (False, False), "GenerateStream": (False, True), "GetModelInfo": (False, False),
                       "Transcribe": (False, False), "TranscribeStream": (False, True)}
    sp = specserve_pb2.SamplingParams.DESCRIPTOR
    # Fields whose default differs from the proto3 zero must track presence.
    for name in ("temperature", "top_p", "max_tokens", "seed"):
        assert sp.fields_by_name[name].has_presence, name
    assert [f.name for f in specserve_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields] == [
        "prompt", "prompt_token_ids", "messages",
    ]  # fmt: skip
