"""What the mock holds per live request."""

from __future__ import annotations

from array import array

from xxhash import xxh3_64, xxh3_64_intdigest

from engine_core.abc import NewRequestData
from engine_core_mock._copy import CopyRule
from engine_core_mock._sampling import LogitBias

__all__ = ["RequestState", "request_seed"]
_ROOT_FINGERPRINT = xxh3_64_intdigest(b"engine-core-mock/kv/v1")
_U64 = (1 << 64) - 1


def request_seed(req_id: str, sampling_seed: int | None, engine_seed: int) -> int:
    """The seed of a request's random stream: its own seed, else one derived from the engine's
    seed and the request id (stable across processes: no salted ``hash()``)."""
    if sampling_seed is not None:
        return sampling_seed & _U64
    return xxh3_64_intdigest(req_id.encode(), seed=engine_seed & _U64)


class RequestState:
    """A live request as the mock sees it: its tokens, KV progress and block table."""

    __slots__ = (
        "req_id",
        "tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_ids",
        "group_tables",
        "released",
        "block_fingerprints",
        "plain",
        "greedy",
        "min_tokens",
        "masked_ids",
        "eos_ids",
        "logit_bias",
        "banned_ids",
        "masked_early",
        "num_logprobs",
        "num_prompt_logprobs",
        "constrained",
        "step_start",
        "hasher",
        "num_hashed",
        "reply",
        "copy",
        "num_tentative",
        "drafts",
        "draft_key",
        "lora_int_id",
        "lora_offset",
    )

    def __init__(
        self,
        new: NewRequestData,
        seed: int,
        reply: list[int] | None = None,
        copy: CopyRule | None = None,
        lora_offset: int = 0,
    ) -> None:
        params = new.sampling_params
        self.req_id = new.req_id
        self.tokens = new.prompt_token_ids + new.output_token_ids
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.block_ids: list[int] = []
        self.group_tables: list[list[int]] | None = None
        """Per KV-cache group, the block table (None until the first blocks; group 0's is
        ``block_ids``); a window group's entries behind its window are -1 once let go."""
        self.released: list[int] | None = None
        """Per group, how many leading entries the mock let go of."""
        self.block_fingerprints: list[int] = []
        self.greedy = params.is_greedy
        self.min_tokens = params.min_tokens
        self.eos_ids = tuple(new.eos_token_ids)
        self.masked_ids = frozenset(new.eos_token_ids) | frozenset(params.stop_token_ids or ())
        self.logit_bias = LogitBias(params.logit_bias) if params.logit_bias else None
        self.banned_ids = self.logit_bias.banned if self.logit_bias is not None else frozenset()
        self.masked_early = self.masked_ids | self.banned_ids
        self.num_logprobs = params.logprobs
        # A resumed request already delivered its prompt logprobs before the preemption.
        self.num_prompt_logprobs = None if new.output_token_ids else params.prompt_logprobs
        self.constrained = params.structured_outputs is not None
        self.plain = (
            self.greedy
            and not (self.min_tokens and self.masked_ids)
            and self.num_logprobs is None
            and self.num_prompt_logprobs is None
            and not self.constrained
            and self.logit_bias is None
            and reply is None
            and copy is None
            and not lora_offset
        )
        self.lora_int_id = new.lora_int_id
        self.lora_offset = lora_offset
        """A LoRA adapter's shift of the greedy rule (``mock.json``'s offset; 0: none)."""
        self.step_start = new.num_computed_tokens
        self.hasher = None if self.greedy else xxh3_64(seed=seed)
        self.num_hashed = 0
        self.reply = reply
        """The scripted reply's token ids, which the first outputs follow (None: no reply)."""
        self.copy = copy
        self.drafts: list[int] = []
        """The drafts this step verifies (speculative decoding; empty: none)."""
        self.draft_key: int | None = None
        """What the drafter's draws for this request hash with (set at its first drafts)."""
        self.num_tentative = 0
        """Drafts appended to ``tokens`` while the drafter asks what would follow them; they
        never enter the random stream's hash state."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def reply_token(self) -> int | None:
        """The scripted reply's token for the next output, else the prompt token it copies
        (None: neither, and the rule decides)."""
        reply = self.reply
        index = len(self.tokens) - self.num_prompt_tokens
        if reply is not None and index < len(reply):
            return reply[index]
        copy = self.copy
        return None if copy is None else copy.token(self.tokens, self.num_prompt_tokens, index)

    def masked(self) -> frozenset[int] | None:
        """Token ids excluded now: those ``logit_bias`` bans, and stop ids while fewer than
        ``min_tokens`` outputs exist."""
        if self.masked_ids and self.num_output_tokens < self.min_tokens:
            return self.masked_early
        return self.banned_ids or None

    def random_draw(self) -> int:
        """The stable 64-bit hash of (seed, token history): this step's random number."""
        hasher = self.hasher
        assert hasher is not None
        tokens = self.tokens
        end = len(tokens) - self.num_tentative
        if self.num_hashed < end:
            hasher.update(array("I", tokens[self.num_hashed : end]).tobytes())
            self.num_hashed = end
        if self.num_tentative:
            hasher = hasher.copy()
            hasher.update(array("I", tokens[end:]).tobytes())
        return hasher.intdigest()

    def random_token(self, vocab_size: int) -> int:
        """The token drawn from the stable hash of (seed, token history)."""
        return self.random_draw() % vocab_size

    def block_fingerprint(self, index: int, block_size: int) -> int:
        """Fingerprint of the token prefix that ends with full block ``index``."""
        fingerprints = self.block_fingerprints
        tokens = self.tokens
        while len(fingerprints) <= index:
            i = len(fingerprints)
            parent = fingerprints[-1] if fingerprints else _ROOT_FINGERPRINT
            chunk = array("I", tokens[i * block_size : (i + 1) * block_size]).tobytes()
            fingerprints.append(xxh3_64_intdigest(chunk, seed=parent))
        return fingerprints[index]
