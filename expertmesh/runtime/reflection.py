"""gRPC server reflection under both names clients ask for: grpc.reflection.v1alpha (older grpcurl, grpc_cli)
and grpc.reflection.v1 (current grpcurl, Postman, buf curl).

grpcio-reflection ships only the v1alpha service; v1's reflection.proto is the same messages with the same field
numbers under a new package, so one servicer answers both — the v1 method reuses v1alpha's (wire-identical) codecs.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: list[str], server: grpc.Server) -> None:
    """Serve reflection v1alpha and v1 for `service_names` (both reflection services are listed as well)."""
    names = [*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.ReflectionServicer(names)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
