import pytest

from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.serving.server import build_service


@pytest.fixture(scope="session")
def local_service():
    """The embedded SmolLM2 on CPU in float32, transfer mode 'local' (no decode)."""
    svc = build_service(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, token_budget=256,
                                     max_queue_wait_s=2.0, lease_ttl_s=30.0),
                        ServerConfig(transfer_mode="local"))
    svc.worker.engine.start()
    yield svc
    svc.worker.engine.stop()
