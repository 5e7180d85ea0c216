"""What self-speculative decoding did, counted as vLLM counts it (``spec_decode_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # cycles that ended
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per draft position i: how many cycles drafted it, and how many accepted it
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_spec_rows: int = 0  # SPECULATIVE rows sent (each one pass of a cycle)

    def record_cycle(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            if i < accepted:
                self.accepted_per_position[i] += 1

    def acceptance_per_position(self) -> list[float]:
        return [
            a / n if n else 0.0
            for a, n in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        ]
