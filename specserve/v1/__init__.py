"""Generated Python stubs for the public gRPC contract ``protos/specserve/v1/specserve.proto``.

The proto package ``specserve.v1`` maps one to one onto this Python package, so
the generated ``specserve_pb2_grpc`` imports ``specserve.v1.specserve_pb2`` as
generated, with no rewriting.  The stubs are committed; after editing the
.proto run ``python -m specserve.v1.regenerate`` (needs grpcio-tools, a dev
dependency).  ``tests/server/test_proto.py`` regenerates into a temporary
directory and compares.
"""
