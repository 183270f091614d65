from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_PATH_EAGER: _ClassVar[StepPath]
    STEP_PATH_DECODE_GRAPH: _ClassVar[StepPath]
    STEP_PATH_MIXED_GRAPH: _ClassVar[StepPath]
    STEP_PATH_MULTI_DECODE: _ClassVar[StepPath]
STEP_PATH_EAGER: StepPath
STEP_PATH_DECODE_GRAPH: StepPath
STEP_PATH_MIXED_GRAPH: StepPath
STEP_PATH_MULTI_DECODE: StepPath

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "tokenizer_path", "architecture", "dtype", "block_size", "num_kv_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "attention_backend", "vocab_size", "eos_token_ids", "max_logprobs", "device", "weight_bytes", "kv_bytes_per_token", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "layer_params", "max_decode_steps", "masks_follow", "instance_id", "kv_cache_dtype", "generation_config")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_path: str
    architecture: str
    dtype: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    attention_backend: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_logprobs: int
    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    layer_params: int
    max_decode_steps: int
    masks_follow: bool
    instance_id: str
    kv_cache_dtype: str
    generation_config: GenerationConfig
    def __init__(self, model: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_logprobs: _Optional[int] = ..., device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_hidden_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_params: _Optional[int] = ..., max_decode_steps: _Optional[int] = ..., masks_follow: _Optional[bool] = ..., instance_id: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., generation_config: _Optional[_Union[GenerationConfig, _Mapping]] = ...) -> None: ...

class GenerationConfig(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "has_seed", "seed", "num_logprobs", "min_tokens", "stop_token_ids", "logit_bias_ids", "logit_bias_values", "masked")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    has_seed: bool
    seed: int
    num_logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    masked: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., masked: _Optional[bool] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("index", "allowed", "same_as")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    SAME_AS_FIELD_NUMBER: _ClassVar[int]
    index: int
    allowed: bytes
    same_as: int
    def __init__(self, index: _Optional[int] = ..., allowed: _Optional[bytes] = ..., same_as: _Optional[int] = ...) -> None: ...

class SequenceInit(_message.Message):
    __slots__ = ("seq_id", "sampling", "num_prompt_tokens", "prior_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int
    prior_token_ids: bytes
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., prior_token_ids: _Optional[bytes] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "seq_ids", "num_tokens", "start_pos", "token_ids", "slot_mapping", "num_new_blocks", "new_block_ids", "sample", "inits", "dropped_seq_ids", "num_steps", "decode_budget", "token_masks", "masks_follow", "masks_only", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    INITS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    MASKS_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: bytes
    num_tokens: bytes
    start_pos: bytes
    token_ids: bytes
    slot_mapping: bytes
    num_new_blocks: bytes
    new_block_ids: bytes
    sample: bytes
    inits: _containers.RepeatedCompositeFieldContainer[SequenceInit]
    dropped_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_steps: int
    decode_budget: bytes
    token_masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    masks_follow: bool
    masks_only: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobsAsk]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[bytes] = ..., num_tokens: _Optional[bytes] = ..., start_pos: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., slot_mapping: _Optional[bytes] = ..., num_new_blocks: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ..., sample: _Optional[bytes] = ..., inits: _Optional[_Iterable[_Union[SequenceInit, _Mapping]]] = ..., dropped_seq_ids: _Optional[_Iterable[int]] = ..., num_steps: _Optional[int] = ..., decode_budget: _Optional[bytes] = ..., token_masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ..., masks_follow: _Optional[bool] = ..., masks_only: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobsAsk, _Mapping]]] = ...) -> None: ...

class PromptLogprobsAsk(_message.Message):
    __slots__ = ("index", "next_token_ids", "num_top")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    index: int
    next_token_ids: bytes
    num_top: int
    def __init__(self, index: _Optional[int] = ..., next_token_ids: _Optional[bytes] = ..., num_top: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("index", "logprobs", "top_token_ids", "top_logprobs", "ranks")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    index: int
    logprobs: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    ranks: bytes
    def __init__(self, index: _Optional[int] = ..., logprobs: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., ranks: _Optional[bytes] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: bytes
    logprobs: bytes
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_us", "execute_us", "idle_us", "path", "launch_us")
    PREPARE_US_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_US_FIELD_NUMBER: _ClassVar[int]
    IDLE_US_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_US_FIELD_NUMBER: _ClassVar[int]
    prepare_us: int
    execute_us: int
    idle_us: int
    path: StepPath
    launch_us: int
    def __init__(self, prepare_us: _Optional[int] = ..., execute_us: _Optional[int] = ..., idle_us: _Optional[int] = ..., path: _Optional[_Union[StepPath, str]] = ..., launch_us: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "sampled_logprobs", "top_logprobs", "error", "timings", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: bytes
    sampled_logprobs: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    error: str
    timings: StepTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., sampled_logprobs: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
