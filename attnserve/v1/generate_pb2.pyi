from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]

class BeamStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BEAM_STOPPING_HEURISTIC: _ClassVar[BeamStopping]
    BEAM_STOPPING_EARLY: _ClassVar[BeamStopping]
    BEAM_STOPPING_NEVER: _ClassVar[BeamStopping]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
BEAM_STOPPING_HEURISTIC: BeamStopping
BEAM_STOPPING_EARLY: BeamStopping
BEAM_STOPPING_NEVER: BeamStopping

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logit_bias")
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
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "stopping", "n", "top_logprobs", "echo", "logprobs", "truncate_prompt", "prompt_logprobs", "beam_width", "length_penalty", "beam_stopping", "priority", "model", "json_schema", "json_object", "regex", "choice", "grammar")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    BEAM_STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    n: int
    top_logprobs: int
    echo: bool
    logprobs: bool
    truncate_prompt: bool
    prompt_logprobs: int
    beam_width: int
    length_penalty: float
    beam_stopping: BeamStopping
    priority: int
    model: str
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., n: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., truncate_prompt: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., beam_stopping: _Optional[_Union[BeamStopping, str]] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms", "total_ms", "cached_prompt_tokens", "draft_tokens", "accepted_draft_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    cached_prompt_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "beam_score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    beam_score: float
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., beam_score: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "completions", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "index", "text", "token_ids", "logprobs", "finish_reason", "usage", "prompt_logprobs", "beam_score")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    beam_score: float
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., beam_score: _Optional[float] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: str
    model: str
    def __init__(self, text: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "context_tokens", "eos_token_id", "dtype", "provider", "graph", "architecture", "attention_heads", "kv_heads", "eos_token_ids", "layers", "kind", "source_tokens", "decoder_start_token_id", "encoder_layers", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODER_START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    context_tokens: int
    eos_token_id: int
    dtype: str
    provider: str
    graph: str
    architecture: str
    attention_heads: int
    kv_heads: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    layers: int
    kind: str
    source_tokens: int
    decoder_start_token_id: int
    encoder_layers: int
    state: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_tokens: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., provider: _Optional[str] = ..., graph: _Optional[str] = ..., architecture: _Optional[str] = ..., attention_heads: _Optional[int] = ..., kv_heads: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., layers: _Optional[int] = ..., kind: _Optional[str] = ..., source_tokens: _Optional[int] = ..., decoder_start_token_id: _Optional[int] = ..., encoder_layers: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("requests_running", "requests_waiting", "kv_slots", "kv_free_slots", "kv_free_tokens", "uptime_seconds", "tokens_per_second", "version", "kv_tokens")
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests_running: int
    requests_waiting: int
    kv_slots: int
    kv_free_slots: int
    kv_free_tokens: int
    uptime_seconds: float
    tokens_per_second: float
    version: str
    kv_tokens: int
    def __init__(self, requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_slots: _Optional[int] = ..., kv_free_slots: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., version: _Optional[str] = ..., kv_tokens: _Optional[int] = ...) -> None: ...
