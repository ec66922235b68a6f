from expertmesh.protos import sampling_pb2 as _sampling_pb2
from expertmesh.protos import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandOffRequest(_message.Message):
    __slots__ = ("seq_id", "to_address", "to_seq_id", "reserve_tokens", "owner", "transport")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TO_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    to_address: str
    to_seq_id: str
    reserve_tokens: int
    owner: str
    transport: str
    def __init__(self, seq_id: _Optional[str] = ..., to_address: _Optional[str] = ..., to_seq_id: _Optional[str] = ..., reserve_tokens: _Optional[int] = ..., owner: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class HandOffDone(_message.Message):
    __slots__ = ("free_blocks", "bytes", "seconds")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    bytes: int
    seconds: float
    def __init__(self, free_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ImportSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "params", "thinking", "reserve_tokens", "owner", "cache_bytes", "sampler_state", "observed")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    params: _sampling_pb2.SamplingParams
    thinking: ThinkingControl
    reserve_tokens: int
    owner: str
    cache_bytes: int
    sampler_state: bytes
    observed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., thinking: _Optional[_Union[ThinkingControl, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., owner: _Optional[str] = ..., cache_bytes: _Optional[int] = ..., sampler_state: _Optional[bytes] = ..., observed: _Optional[_Iterable[int]] = ...) -> None: ...

class ImportSequencePart(_message.Message):
    __slots__ = ("header", "cache", "engine")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    header: ImportSequenceRequest
    cache: bytes
    engine: EngineTransfer
    def __init__(self, header: _Optional[_Union[ImportSequenceRequest, _Mapping]] = ..., cache: _Optional[bytes] = ..., engine: _Optional[_Union[EngineTransfer, _Mapping]] = ...) -> None: ...

class EngineTransfer(_message.Message):
    __slots__ = ("session", "address", "length")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session: str
    address: int
    length: int
    def __init__(self, session: _Optional[str] = ..., address: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ConnectExpertsRequest(_message.Message):
    __slots__ = ("addresses", "moe_layers", "replicas", "call_timeout_s", "transport")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    replicas: _tensor_pb2.Tensor
    call_timeout_s: float
    transport: str
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., moe_layers: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., call_timeout_s: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class ConnectExpertsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertLoadResponse(_message.Message):
    __slots__ = ("moe_layers", "tokens")
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    tokens: _tensor_pb2.Tensor
    def __init__(self, moe_layers: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class AttentionInfo(_message.Message):
    __slots__ = ("name", "model", "block_size", "total_blocks", "free_blocks", "sequences", "prefixes", "experts_down", "pool", "speculative_tokens", "speculative_method")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_DOWN_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    block_size: int
    total_blocks: int
    free_blocks: int
    sequences: int
    prefixes: int
    experts_down: _containers.RepeatedScalarFieldContainer[int]
    pool: str
    speculative_tokens: int
    speculative_method: str
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., sequences: _Optional[int] = ..., prefixes: _Optional[int] = ..., experts_down: _Optional[_Iterable[int]] = ..., pool: _Optional[str] = ..., speculative_tokens: _Optional[int] = ..., speculative_method: _Optional[str] = ...) -> None: ...

class OpenSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "params", "reserve_tokens", "prefix_key", "owner", "images", "thinking")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    params: _sampling_pb2.SamplingParams
    reserve_tokens: int
    prefix_key: str
    owner: str
    images: _containers.RepeatedCompositeFieldContainer[ImageSpan]
    thinking: ThinkingControl
    def __init__(self, seq_id: _Optional[str] = ..., params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., prefix_key: _Optional[str] = ..., owner: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageSpan, _Mapping]]] = ..., thinking: _Optional[_Union[ThinkingControl, _Mapping]] = ...) -> None: ...

class ThinkingControl(_message.Message):
    __slots__ = ("phase", "limit", "think_start", "think_end", "stop", "not_in_answer", "end_of_turn")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    THINK_START_FIELD_NUMBER: _ClassVar[int]
    THINK_END_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_ANSWER_FIELD_NUMBER: _ClassVar[int]
    END_OF_TURN_FIELD_NUMBER: _ClassVar[int]
    phase: str
    limit: int
    think_start: int
    think_end: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    not_in_answer: _containers.RepeatedScalarFieldContainer[int]
    end_of_turn: int
    def __init__(self, phase: _Optional[str] = ..., limit: _Optional[int] = ..., think_start: _Optional[int] = ..., think_end: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ..., not_in_answer: _Optional[_Iterable[int]] = ..., end_of_turn: _Optional[int] = ...) -> None: ...

class ImageSpan(_message.Message):
    __slots__ = ("position", "pixels")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    position: int
    pixels: _tensor_pb2.Tensor
    def __init__(self, position: _Optional[int] = ..., pixels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ImageEncode(_message.Message):
    __slots__ = ("seq_id", "tokens", "seconds")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tokens: int
    seconds: float
    def __init__(self, seq_id: _Optional[str] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class OpenSequenceResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class CloseSequenceRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class ExtendSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "reserve_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    reserve_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class SavePrefixRequest(_message.Message):
    __slots__ = ("seq_id", "key")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    key: str
    def __init__(self, seq_id: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class DropPrefixRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DemotedPrefix(_message.Message):
    __slots__ = ("free_blocks", "dropped")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, free_blocks: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class CachedPrefix(_message.Message):
    __slots__ = ("key", "length", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: str
    length: int
    tier: str
    def __init__(self, key: _Optional[str] = ..., length: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class PrefixList(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[CachedPrefix]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[CachedPrefix, _Mapping]]] = ...) -> None: ...

class FreeBlocks(_message.Message):
    __slots__ = ("free_blocks",)
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    def __init__(self, free_blocks: _Optional[int] = ...) -> None: ...

class StepSegment(_message.Message):
    __slots__ = ("seq_id", "token_ids", "sample", "max_new", "hold_at")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_FIELD_NUMBER: _ClassVar[int]
    HOLD_AT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    max_new: int
    hold_at: int
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., max_new: _Optional[int] = ..., hold_at: _Optional[int] = ...) -> None: ...

class SnapshotKey(_message.Message):
    __slots__ = ("seq_id", "key", "length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    key: str
    length: int
    def __init__(self, seq_id: _Optional[str] = ..., key: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class RunStepRequest(_message.Message):
    __slots__ = ("step_id", "segments", "snapshot_keys")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEYS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    segments: _containers.RepeatedCompositeFieldContainer[StepSegment]
    snapshot_keys: _containers.RepeatedCompositeFieldContainer[SnapshotKey]
    def __init__(self, step_id: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[StepSegment, _Mapping]]] = ..., snapshot_keys: _Optional[_Iterable[_Union[SnapshotKey, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token", "more", "drafted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token: int
    more: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    def __init__(self, seq_id: _Optional[str] = ..., token: _Optional[int] = ..., more: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("seq_id", "position", "token_ids", "logprobs", "top_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    position: int
    token_ids: _tensor_pb2.Tensor
    logprobs: _tensor_pb2.Tensor
    top_ids: _tensor_pb2.Tensor
    top_logprobs: _tensor_pb2.Tensor
    def __init__(self, seq_id: _Optional[str] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SequenceFailure(_message.Message):
    __slots__ = ("seq_id", "reason")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    reason: str
    def __init__(self, seq_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StepDone(_message.Message):
    __slots__ = ("step_id", "tokens", "free_blocks", "logprobs", "failed", "experts_down", "exchange_bytes", "image_encodes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_DOWN_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ENCODES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    free_blocks: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    failed: _containers.RepeatedCompositeFieldContainer[SequenceFailure]
    experts_down: _containers.RepeatedScalarFieldContainer[int]
    exchange_bytes: int
    image_encodes: _containers.RepeatedCompositeFieldContainer[ImageEncode]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., free_blocks: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[SequenceFailure, _Mapping]]] = ..., experts_down: _Optional[_Iterable[int]] = ..., exchange_bytes: _Optional[int] = ..., image_encodes: _Optional[_Iterable[_Union[ImageEncode, _Mapping]]] = ...) -> None: ...

class SetShardsRequest(_message.Message):
    __slots__ = ("experts", "gpus", "drop_others")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DROP_OTHERS_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    gpus: _containers.RepeatedScalarFieldContainer[int]
    drop_others: bool
    def __init__(self, experts: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., gpus: _Optional[_Iterable[int]] = ..., drop_others: _Optional[bool] = ...) -> None: ...

class OpenCollectiveRequest(_message.Message):
    __slots__ = ("group_id", "timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    timeout_s: float
    def __init__(self, group_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OpenStepChannelRequest(_message.Message):
    __slots__ = ("channel_id", "timeout_s")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    timeout_s: float
    def __init__(self, channel_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OpenStepChannelResponse(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class OpenCollectiveResponse(_message.Message):
    __slots__ = ("store_port", "backend")
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    store_port: int
    backend: str
    def __init__(self, store_port: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class ExpertKey(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class ExpertInfo(_message.Message):
    __slots__ = ("name", "model", "experts", "grpc_calls", "collective_calls", "collective_pairs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    GRPC_CALLS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_CALLS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    experts: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    grpc_calls: int
    collective_calls: int
    collective_pairs: int
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., grpc_calls: _Optional[int] = ..., collective_calls: _Optional[int] = ..., collective_pairs: _Optional[int] = ...) -> None: ...

class RunExpertsRequest(_message.Message):
    __slots__ = ("layer", "hidden", "expert_ids", "weights", "output_dtype")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden: _tensor_pb2.Tensor
    expert_ids: _tensor_pb2.Tensor
    weights: _tensor_pb2.Tensor
    output_dtype: str
    def __init__(self, layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., expert_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., output_dtype: _Optional[str] = ...) -> None: ...

class RunExpertsResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.Tensor
    def __init__(self, output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
