"""Validated configuration objects: one for sampling, one per service."""

from __future__ import annotations

import dataclasses
import os

# How a CPU target's quantized linear layers compute (specdec.serving.kernels, README):
# "float": float32 on the weights the codes encode (transformers' numbers, within rounding);
# "integer": llama.cpp's integer dot products (activations to int8 per block of 32, exact
# int32 block sums) in the decoder layers, the head float on its codes (engine._load_weights);
# every position's logits bit-identical whichever pass computes them.
# Integer is the default: on the default target it is 1.21-1.40x float end to end
# (docs/performance.md), and a model with no codes (a Hugging Face directory, a GPU, no C
# compiler) runs float whatever is asked, so only a GGUF target on CPU computes otherwise
# than transformers' float32 (README, "Numerics").
NUMERICS = ("float", "integer")
DEFAULT_NUMERICS = "integer"
# The models' weight and activation dtype: "auto" is bfloat16 on CUDA, float32 elsewhere (the
# CPU kernels are float32). Logits, RMSNorm statistics, acceptance and sampling are float32
# whatever this is (specdec.serving.engine).
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_DTYPE = "auto"

MAX_K = 64
# Plain target steps one verify call may take after its verdict (VerifyRequest.decode_on).
MAX_DECODE_ON = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)
# Below this temperature logits / temperature overflows float32 (NaN probabilities); greedy
# decoding is the limit of sampling as the temperature goes to 0, so it is used instead (as
# vLLM does below 1e-5).
GREEDY_BELOW_TEMPERATURE = 1e-5
# The wire carries temperature as a float32 and top_k as an int32.
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = 2**31 - 1
# Acceptance rules of sampled decoding (see specdec.serving.acceptance), by their AcceptanceRule
# numbers on the wire (0, unspecified, is read as the default).
RULE_NUMBERS = {"coupled": 1, "rejection": 2}
RULES = tuple(RULE_NUMBERS)
DEFAULT_RULE = "coupled"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How logits become tokens. ``temperature == 0`` (or below 1e-5) means greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k limit
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    seed: int = 0
    rule: str = DEFAULT_RULE  # "coupled" | "rejection" (sampling only; see specdec.serving.acceptance)
    presence_penalty: float = 0.0  # OpenAI's, on output tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, on output tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # HF's / vLLM's, on prompt and output tokens, > 0
    prompt_len: int = 0  # leading tokens that are the prompt (not output) for the first two
    # Grammar (xgrammar EBNF) the output tokens must match; "" = unconstrained. Every service
    # masks its logits with it (specdec.serving.grammar).
    grammar: str = ""
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits before
    # temperature, sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= _FLOAT32_MAX):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 <= self.top_k <= _INT32_MAX):
            raise ValueError(f"top_k must be in [0, {_INT32_MAX}] (0 = no limit), "
                             f"got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 1e4:
            raise ValueError(f"repetition_penalty must be in (0, 10000], got "
                             f"{self.repetition_penalty}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token ids must be >= 0, got {token}")
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(f"logit_bias: biases must be in [-100, 100], got {bias} for "
                                 f"token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def drafter_invariant(self) -> bool:
        """Each position's token is a function of the target's logits and (seed, position)
        only (greedy, or the coupled rule): a round is a walk along the target's own tokens,
        no draft distribution is needed, and no k or draft can change the text."""
        return self.greedy or self.rule == "coupled"

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_wire(cls, msg) -> "SamplingParams":
        """Build from a ``specdec.v1.SamplingParams`` message (top_p 0, proto3's "unset", is
        read as 1; a negative or NaN top_p is refused like any other; rule UNSPECIFIED is the
        default rule)."""
        rule_value = int(msg.rule)
        if rule_value not in _RULE_OF_WIRE:
            raise ValueError(f"unknown acceptance rule {rule_value}")
        return cls(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
            seed=int(msg.seed),
            rule=_RULE_OF_WIRE[rule_value],
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty != 0
            else 1.0,
            prompt_len=int(msg.prompt_len),
            grammar=msg.grammar,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        )

    def to_wire(self, pb):
        return pb.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            rule=RULE_NUMBERS[self.rule], presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, prompt_len=self.prompt_len,
            grammar=self.grammar, logit_bias=dict(self.logit_bias),
        )


_RULE_OF_WIRE = {0: DEFAULT_RULE, **{n: r for r, n in RULE_NUMBERS.items()}}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


INT8 = "int8"  # "int8:<spec>": that model with weight-only int8 linear layers (a draft only)


def split_quantization(spec: str) -> tuple[str | None, str]:
    """("int8", "default") for "int8:default"; (None, spec) for a spec without a quantization.
    (A path with a colon is read as a path unless it starts with "int8:".)"""
    head, sep, rest = spec.partition(":")
    if sep and head == INT8:
        if not rest:
            raise ValueError(f"{spec!r}: int8: needs a model spec after it, e.g. int8:default")
        return INT8, rest
    return None, spec


@dataclasses.dataclass
class ServiceConfig:
    """Settings of one model service (draft or target)."""

    model: str = "default"
    role: str = "target"  # "draft" | "target"
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # KV cache memory across sessions; 0: the default (on a GPU the free memory left after the
    # weights, less room for a pass, specdec.serving.kvcache.kv_pool_bytes; on a CPU 1024)
    cache_cap_mb: int = 0
    max_sessions: int = 256
    session_ttl_s: float = 600.0  # idle sessions expire after this long
    max_message_bytes: int = 8 * 1024 * 1024
    max_batch: int = 16  # sessions merged into one forward pass
    # Wait this long, starting from idle, for other calls to join the first pass. 0: continuous
    # batching already lets later calls join the next pass, and a lone call pays nothing.
    batch_wait_ms: float = 0.0
    # After a pass, wait up to this long for the sessions it answered to send their next
    # calls (a round trip away), so concurrent sessions share passes rather than alternate
    # in groups (BatchScheduler._regroup). A lone session pays nothing: nothing else waits.
    regroup_ms: float = 5.0
    prefill_chunk: int = 256  # prompt tokens of a pass no session waits on
    # what prefill may add to a pass a session waits on, as a share of a decode-only pass
    # (specdec.serving.scheduler.PrefillBudget): 0.5 keeps ~2/3 of a decoding session's speed
    prefill_share: float = 0.5
    kernels: str = "auto"  # CPU linear kernels: auto (fastest per row count), onednn, mkl, mkl-t
    numerics: str = DEFAULT_NUMERICS  # float | integer (NUMERICS)
    dtype: str = DEFAULT_DTYPE  # auto | float32 | bfloat16 | float16 (DTYPES)
    calibrate: bool = True  # measure forward costs at start (reported in GetInfo)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set to require client certificates (mutual TLS)

    def __post_init__(self) -> None:
        if self.role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target', got {self.role!r}")
        if split_quantization(self.model)[0] is not None and self.role == "target":
            raise ValueError(f"model {self.model!r}: a quantized model can be a draft, not a "
                             "target (the target defines the text; int8:<spec> is a draft "
                             "for the target <spec>)")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.cache_cap_mb < 0:
            raise ValueError(f"cache_cap_mb must be >= 0 (0: the default), got "
                             f"{self.cache_cap_mb}")
        if self.max_sessions <= 0:
            raise ValueError(f"max_sessions must be > 0, got {self.max_sessions}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        from specdec.serving.kernels import KERNEL_CHOICES  # (the kernels' one registry)

        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, "
                             f"got {self.kernels!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, "
                             f"got {self.numerics!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.regroup_ms < 0:
            raise ValueError(f"regroup_ms must be >= 0, got {self.regroup_ms}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if not self.prefill_share > 0:
            raise ValueError(f"prefill_share must be > 0, got {self.prefill_share}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")

    @property
    def cache_cap_bytes(self) -> int | None:
        """The KV cache cap in bytes; None: the default for the device."""
        return self.cache_cap_mb * 1024 * 1024 or None
