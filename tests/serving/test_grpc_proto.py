"""The committed stubs (prefill_server/serving/pb/) are fresh against proto/prefill/v1/prefill.proto.

protoc runs in a child process: its extension (grpc_tools._protoc_compiler) loaded into the test
process corrupts the heap of a NIXL UCX agent created later in the same process (the abort of
``pytest tests/serving`` in test_prefill_instance.py)."""
import pathlib
import subprocess
import sys

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import grpc_version

from prefill_server.serving import grpc_server
from prefill_server.serving.pb import prefill_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
PB_DIR = ROOT / "prefill_server" / "serving" / "pb"
FILES = ("prefill_pb2.py", "prefill_pb2.pyi", "prefill_pb2_grpc.py")


def _protoc_descriptor(tmp_path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "set.pb"
    wkt = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"-I{wkt}",
                         f"--descriptor_set_out={out}", "prefill/v1/prefill.proto"]).returncode
    assert rc == 0, "protoc failed on proto/prefill/v1/prefill.proto"
    (fd,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    _strip_json_names(fd.message_type)  # generated code leaves out the default json_name
    return fd


def _strip_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)


def test_committed_stubs_describe_the_proto(tmp_path):
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert committed == _protoc_descriptor(tmp_path), \
        "prefill_server/serving/pb/ is stale: run scripts/gen_proto.sh and commit the result"


def test_committed_stubs_are_the_generator_output(tmp_path):
    generated_with = next(line.split("'")[1] for line in (PB_DIR / "prefill_pb2_grpc.py").read_text().splitlines()
                          if line.startswith("GRPC_GENERATED_VERSION"))
    if generated_with != grpc_version.VERSION:
        pytest.skip(f"stubs were generated with grpcio-tools {generated_with}, {grpc_version.VERSION} is "
                    "installed (the descriptor check above still applies)")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    for name in FILES:
        assert (tmp_path / name).read_text() == (PB_DIR / name).read_text(), \
            f"{name} is stale: run scripts/gen_proto.sh and commit the result"


def test_protoc_is_not_loaded_into_the_test_process():
    assert "grpc_tools._protoc_compiler" not in sys.modules


def test_servicer_implements_every_method():
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["PrefillService"].methods]
    assert methods == ["Prefill", "PrefillStream", "Release", "GetServerInfo", "ListWorkers", "ResetPrefixCache"]
    for name in methods:
        assert name in vars(grpc_server.PrefillServicer), name
    assert grpc_server.SERVICE_NAME == "prefill.v1.PrefillService"
