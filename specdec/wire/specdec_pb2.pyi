from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcceptanceRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCEPTANCE_RULE_UNSPECIFIED: _ClassVar[AcceptanceRule]
    COUPLED: _ClassVar[AcceptanceRule]
    REJECTION: _ClassVar[AcceptanceRule]
ACCEPTANCE_RULE_UNSPECIFIED: AcceptanceRule
COUPLED: AcceptanceRule
REJECTION: AcceptanceRule

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "rule", "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_len", "grammar", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    rule: AcceptanceRule
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_len: int
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., rule: _Optional[_Union[AcceptanceRule, str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., prompt_len: _Optional[int] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "dim", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    dim: int
    data: bytes
    def __init__(self, start: _Optional[int] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "prefix_len", "prefix_hash")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_len: int
    prefix_hash: int
    def __init__(self, session_id: _Optional[str] = ..., prefix_len: _Optional[int] = ..., prefix_hash: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session", "tokens", "k", "sampling", "request_id", "branches", "features")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: SamplingParams
    request_id: str
    branches: BranchSpec
    features: Features
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., branches: _Optional[_Union[BranchSpec, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class BranchSpec(_message.Message):
    __slots__ = ("block_len", "width", "depth")
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    block_len: int
    width: int
    depth: int
    def __init__(self, block_len: _Optional[int] = ..., width: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class BranchBlock(_message.Message):
    __slots__ = ("accepted", "token", "tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[int] = ..., token: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tokens", "dists", "cache_len", "compute_ms", "branches")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[SparseDist]
    cache_len: int
    compute_ms: float
    branches: _containers.RepeatedCompositeFieldContainer[BranchBlock]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[SparseDist, _Mapping]]] = ..., cache_len: _Optional[int] = ..., compute_ms: _Optional[float] = ..., branches: _Optional[_Iterable[_Union[BranchBlock, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session", "tokens", "draft_tokens", "draft_dists", "sampling", "request_id", "logprobs", "top_logprobs", "prompt_logprobs", "decode_on", "stop_ids", "return_features", "features_from", "feature_layers")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ON_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[SparseDist]
    sampling: SamplingParams
    request_id: str
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    decode_on: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    features_from: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[SparseDist, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., decode_on: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ..., features_from: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "cache_len", "compute_ms", "batch_size", "logprobs", "prompt_logprobs", "pass_tokens", "queued_ms", "decoded", "passes", "features")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    cache_len: int
    compute_ms: float
    batch_size: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    pass_tokens: int
    queued_ms: float
    decoded: _containers.RepeatedScalarFieldContainer[int]
    passes: int
    features: Features
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cache_len: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., pass_tokens: _Optional[int] = ..., queued_ms: _Optional[float] = ..., decoded: _Optional[_Iterable[int]] = ..., passes: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "role", "tokenizer_fingerprint", "vocab_size", "max_context", "eos_token_ids", "forward_ms", "drafter", "numerics", "features", "feature_dim", "feature_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: str
    tokenizer_fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_ms: _containers.RepeatedScalarFieldContainer[float]
    drafter: str
    numerics: str
    features: bool
    feature_dim: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., role: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., forward_ms: _Optional[_Iterable[float]] = ..., drafter: _Optional[str] = ..., numerics: _Optional[str] = ..., features: _Optional[bool] = ..., feature_dim: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStats(_message.Message):
    __slots__ = ("sessions", "cache_bytes", "cache_cap_bytes", "evictions", "expirations", "calls", "forward_passes")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    cache_bytes: int
    cache_cap_bytes: int
    evictions: int
    expirations: int
    calls: int
    forward_passes: int
    def __init__(self, sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_cap_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., expirations: _Optional[int] = ..., calls: _Optional[int] = ..., forward_passes: _Optional[int] = ...) -> None: ...
