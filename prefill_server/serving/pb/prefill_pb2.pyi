from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_NIXL_PULL: _ClassVar[TransferMode]
    TRANSFER_MODE_PUSH: _ClassVar[TransferMode]
    TRANSFER_MODE_LOCAL: _ClassVar[TransferMode]
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_NIXL_PULL: TransferMode
TRANSFER_MODE_PUSH: TransferMode
TRANSFER_MODE_LOCAL: TransferMode

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("engine_id", "address")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("model", "token_ids", "text", "messages", "add_special_tokens", "sampling", "transfer_mode", "transfer_target", "request_id", "return_prompt_token_ids", "chat_json", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TARGET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_special_tokens: bool
    sampling: SamplingParams
    transfer_mode: TransferMode
    transfer_target: TransferTarget
    request_id: str
    return_prompt_token_ids: bool
    chat_json: str
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., transfer_mode: _Optional[_Union[TransferMode, str]] = ..., transfer_target: _Optional[_Union[TransferTarget, _Mapping]] = ..., request_id: _Optional[str] = ..., return_prompt_token_ids: _Optional[bool] = ..., chat_json: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("tokenize_seconds", "queue_seconds", "prefill_seconds", "total_seconds")
    TOKENIZE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokenize_seconds: float
    queue_seconds: float
    prefill_seconds: float
    total_seconds: float
    def __init__(self, tokenize_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_text", "kv_transfer_params_json", "transfer_mode", "model", "usage", "timings", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_text: str
    kv_transfer_params_json: str
    transfer_mode: TransferMode
    model: str
    usage: Usage
    timings: Timings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_text: _Optional[str] = ..., kv_transfer_params_json: _Optional[str] = ..., transfer_mode: _Optional[_Union[TransferMode, str]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("elapsed_seconds", "queued", "started", "progress", "result")
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    elapsed_seconds: float
    queued: Queued
    started: Started
    progress: Progress
    result: PrefillResponse
    def __init__(self, elapsed_seconds: _Optional[float] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("prompt_tokens", "requests_ahead")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    requests_ahead: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., requests_ahead: _Optional[int] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_tokens", "queue_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    queue_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("tokens_done", "prompt_tokens")
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens_done: int
    prompt_tokens: int
    def __init__(self, tokens_done: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "model_path", "num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len", "block_size", "kv_layout", "kv_dtype", "supported_transfer_modes", "num_kv_blocks", "num_free_kv_blocks", "server_version", "api_version", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_TRANSFER_MODES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    block_size: int
    kv_layout: str
    kv_dtype: str
    supported_transfer_modes: _containers.RepeatedScalarFieldContainer[TransferMode]
    num_kv_blocks: int
    num_free_kv_blocks: int
    server_version: str
    api_version: str
    versions: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., supported_transfer_modes: _Optional[_Iterable[_Union[TransferMode, str]]] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., server_version: _Optional[str] = ..., api_version: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker", "node_ip", "pid", "gpu_ids", "outstanding_tokens", "waiting", "running", "free_kv_blocks", "total_kv_blocks")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    node_ip: str
    pid: int
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    outstanding_tokens: int
    waiting: int
    running: int
    free_kv_blocks: int
    total_kv_blocks: int
    def __init__(self, worker: _Optional[str] = ..., node_ip: _Optional[str] = ..., pid: _Optional[int] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., outstanding_tokens: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("routing", "workers", "replica_states")
    class ReplicaStatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STATES_FIELD_NUMBER: _ClassVar[int]
    routing: str
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    replica_states: _containers.ScalarMap[str, int]
    def __init__(self, routing: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., replica_states: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset", "blocks_freed")
    RESET_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    blocks_freed: int
    def __init__(self, reset: _Optional[bool] = ..., blocks_freed: _Optional[int] = ...) -> None: ...
