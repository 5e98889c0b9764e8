"""Generated stubs of proto/prefill/v1/prefill.proto (package prefill.v1). Do not edit: run
``scripts/gen_proto.sh``; tests/serving/test_grpc_proto.py fails when they are stale."""
