#!/usr/bin/env bash
# Regenerate the committed Python stubs of the gRPC contract from proto/prefill/v1/prefill.proto.
#   scripts/gen_proto.sh            writes prefill_server/serving/pb/prefill_pb2{.py,.pyi,_grpc.py}
#   scripts/gen_proto.sh OUT_DIR    writes them into OUT_DIR instead (tests compare the two)
# Needs grpcio-tools (the `test` extra); the stubs require protobuf/grpcio at least as new as it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/prefill_server/serving/pb}"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The proto keeps its canonical name prefill/v1/prefill.proto (what reflection serves).
"$py" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" prefill/v1/prefill.proto
mkdir -p "$out"
cp "$tmp/prefill/v1/prefill_pb2.py" "$tmp/prefill/v1/prefill_pb2.pyi" "$out/"
# The stubs live in a package of ours: import the message module relatively.
sed 's/^from prefill\.v1 import prefill_pb2 as /from . import prefill_pb2 as /' \
  "$tmp/prefill/v1/prefill_pb2_grpc.py" > "$out/prefill_pb2_grpc.py"
grep -q '^from \. import prefill_pb2 as ' "$out/prefill_pb2_grpc.py" || {
  echo "gen_proto.sh: could not rewrite the import in prefill_pb2_grpc.py" >&2; exit 1; }
