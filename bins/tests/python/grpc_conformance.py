"""The proxy-pool controller as standard gRPC clients see it: `grpcio-health-checking` and
`grpcio-reflection` (the Python packages operators and probes use), against ADDR.

    grpc_conformance.py ADDR check SERVICE          prints the health status of SERVICE ("" = server)
    grpc_conformance.py ADDR watch SERVICE          prints every status Watch streams, one per line
    grpc_conformance.py ADDR reflection             checks both reflection versions, prints "ok"
"""

import sys

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

def require(condition, what):
    """Fails the process when `condition` is false. Not `assert`, which `python -O` and
    PYTHONOPTIMIZE strip, and the check with it."""
    if not condition:
        sys.exit(f"check failed: {what}")


WORKER = "controlplane.v1.WorkerControlPlane"
HEALTH = "grpc.health.v1.Health"


def status_name(code):
    return health_pb2.HealthCheckResponse.ServingStatus.Name(code)


def check(channel, service):
    stub = health_pb2_grpc.HealthStub(channel)
    r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    print(status_name(r.status), flush=True)


def watch(channel, service):
    stub = health_pb2_grpc.HealthStub(channel)
    for r in stub.Watch(health_pb2.HealthCheckRequest(service=service)):
        print(status_name(r.status), flush=True)


def reflection(channel):
    # v1alpha, through the package's own descriptor database (what grpcurl's older releases,
    # grpcui and Postman speak too).
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    for want in (WORKER, HEALTH):
        require(want in services, f"v1alpha lists {sorted(services)}, not {want}")
    pool = descriptor_pool.DescriptorPool(db)
    worker = pool.FindServiceByName(WORKER)
    methods = {m.name for m in worker.methods}
    require({"RegisterWorker", "AcknowledgeSnapshot", "ReportRuntime"} <= methods, methods)
    health = pool.FindServiceByName(HEALTH)
    require({"Check", "Watch"} <= {m.name for m in health.methods}, '{"Check", "Watch"} <= {m.name for m in health.methods}')
    # v1: the same messages on the wire, under the grpc.reflection.v1 service name.
    v1 = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    answers = list(
        v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    )
    names = {s.name for s in answers[0].list_services_response.service}
    for want in (WORKER, HEALTH, "grpc.reflection.v1.ServerReflection"):
        require(want in names, f"v1 lists {sorted(names)}, not {want}")
    print("ok", flush=True)


def main():
    addr, what = sys.argv[1], sys.argv[2]
    with grpc.insecure_channel(addr) as channel:
        if what == "check":
            check(channel, sys.argv[3])
        elif what == "watch":
            watch(channel, sys.argv[3])
        elif what == "reflection":
            reflection(channel)
        else:
            raise SystemExit(f"unknown command {what}")


if __name__ == "__main__":
    main()
