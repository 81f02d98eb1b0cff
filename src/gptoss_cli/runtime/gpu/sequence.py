"""One request inside the GPU engine: its tokens, how many have KV, and the blocks holding it.

Full-attention layers keep a block for every logical block of the sequence. Sliding layers are
paged the same way, but a block is released as soon as no future query can see it (all its
positions are more than `window` behind the next token), so each sequence holds only about
window/BLOCK + 2 sliding blocks: the "ring" is logical, and released full blocks stay in the
prefix cache. Block tables are indexed by logical block in both pools.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..api import RequestOutput, SamplingParams

# The last token of a sequence whose decode step is launched but not read yet (overlap_steps).
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: list.remove / the runner's batch check must not compare token lists
class Sequence:
    out: RequestOutput
    params: SamplingParams
    seed: int
    max_new: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose KV is in the cache
    row: int = -1  # row of the device block tables while running
    full_blocks: list[int] = field(default_factory=list)  # logical block -> full-pool block
    slide_blocks: list[int] = field(default_factory=list)  # logical block -> sliding block, 0 = released
    slide_start: int = 0  # sliding blocks below this index are all released
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each completed logical block
    status: Status = Status.WAITING
    admitted_at: int = 0  # step counter at admission (preemption victim order)

    @property
    def request_id(self) -> str:
        return self.out.request_id

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_generated > 0

    @property
    def num_generated(self) -> int:
        return len(self.out.token_ids)
