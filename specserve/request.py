"""Per-request state: sampling parameters, the Request record, and the outputs users see.

A Request is plain counters and token lists (the scheduler and KV manager mutate it):

    all_token_ids = prompt_token_ids + output_token_ids      (known, committed tokens)
    num_computed_tokens <= len(all_token_ids) + len(spec_token_ids)
    block_ids hold the KV of the first num_computed_tokens positions

Drafts (spec_token_ids) are tentative: they are computed by the target in a verify step and
either become output tokens or are rolled back. Only committed tokens ever enter the prefix
cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.structured import StructuredOutput

_MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_CHARS_EACH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids entries per request


@dataclass
class SamplingParams:
    """Same names and defaults as vLLM's SamplingParams (temperature 0 means greedy)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per output token (0: the sampled one only)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are forbidden before this many output tokens
    structured: StructuredOutput | None = None  # a grammar the output must follow

    @property
    def constrained(self) -> bool:
        """Whether sampling must change the target's logits (grammar, bias, min_tokens)."""
        return self.structured is not None or bool(self.logit_bias) or self.min_tokens > 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS_EACH:
            raise bad("stop", f"each stop string has at most {MAX_STOP_CHARS_EACH} characters, "
                              f"got one of {longest}")
        if (not isinstance(self.stop_token_ids, list)
                or any(type(t) is not int or t < 0 for t in self.stop_token_ids)):
            raise bad("stop_token_ids", "must be a list of non-negative integer token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, "
                                        f"got {len(self.stop_token_ids)}")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be in [-100, 100]")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed while it ran, alone (Engine._recover)

    def __init__(self, value: str) -> None:
        # an attribute, not a property: read for every request several times a step
        self.finished = value in ("stop", "length", "abort", "error")


@dataclass
class TokenLogprob:
    """Logprob of one emitted token and the top-n alternatives (raw target distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # from Engine.step: the tokens new since the request's last output; from LLM.generate: all
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative state of one request: text and token_ids only ever grow while running."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # finish_reason "error": what the user may be told (no details)


class Request:
    """Engine-side state of one sequence (one choice: n > 1 is fanned out above the engine)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], sampling_seed: int, arrival_time: float | None = None,
                 prompt: str | None = None, tenant: str | None = None) -> None:
        self.request_id = request_id
        self.tenant = tenant  # whose earlier outputs it may draft from (suffix decoding)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.sampling_seed = sampling_seed  # drives this request's random stream (batch independent)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # SHA-256 keys of the full committed blocks (chained)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # logprobs of committed tokens not yet in an output (Engine._output hands them over)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_failed_steps = 0  # failed engine steps it was part of (Engine._recover)

    # -- counters ---------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 1 << 62

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
