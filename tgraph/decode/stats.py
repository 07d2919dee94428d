"""What a :class:`~tgraph.decode.DecodeEngine` did: capture once, then per ``generate`` call."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Capture facts (kept across calls) and the latest ``generate`` call's counters."""

    backend: str | None
    """Graph backend (``"cuda"``/``"emulated"``), or None when graphs are off."""
    buckets: list[int]
    """Decode bucket sizes (rows); graphs were captured for them unless graphs are off."""
    prefill_buckets: list[int] = field(default_factory=list)
    """Prefill bucket sizes (prompt tokens); longer prompts prefill eagerly."""
    capture_seconds: float = 0.0
    """Warmup plus capture of every decode and prefill graph (0 without graphs)."""
    pool_bytes: int = 0
    """CUDA memory the graphs' shared pool took (0 on the emulated backend or without graphs)."""
    graph_bytes: dict[str, int] = field(default_factory=dict)
    """Memory the pool grew by at each capture, e.g. ``"decode 8 greedy"``,
    ``"prefill 32 sampling"`` (largest first: smaller graphs mostly reuse the larger ones')."""
    prefills: int = 0
    prefill_seconds: float = 0.0
    """Wall time of the prefills, each up to its first token on the host (time to first token)."""
    prefill_bucket_steps: dict[int, int] = field(default_factory=dict)
    """Prefills run per token-count bucket (graphed, or eager-padded when graphs are off)."""
    prefill_eager: int = 0
    """Prefills longer than the largest bucket, run eagerly without padding."""
    decode_steps: int = 0
    """Decode steps in the latest ``generate`` call."""
    decode_seconds: float = 0.0
    """Wall time of those steps: launches, the host reads of tokens and the bookkeeping."""
    bucket_steps: dict[int, int] = field(default_factory=dict)
    """Steps run per bucket size (graphed, or eager-padded when graphs are off)."""
    sampling_steps: int = 0
    """Steps that ran the sampling variant (some row had temperature > 0)."""
    eager_steps: int = 0
    """Steps larger than the largest bucket, run eagerly without padding."""
    refreshes: int = 0
    """Copies of a new padded batch into the static buffers (a request joined or left)."""
    live_rows: int = 0
    """Sum over steps of the running requests."""
    padded_rows: int = 0
    """Sum over steps of the padding rows (wasted compute)."""
    wasted_rows: int = 0
    """Rows decoded ahead for a request that had just ended with EOS (lookahead), discarded."""
    generated_tokens: int = 0
    total_seconds: float = 0.0
    """Wall time of the latest ``generate`` call."""

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / max(self.decode_steps, 1)

    @property
    def ms_per_prefill(self) -> float:
        return 1e3 * self.prefill_seconds / max(self.prefills, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def padding_waste(self) -> float:
        """Fraction of decoded rows that were padding."""
        return self.padded_rows / max(self.live_rows + self.padded_rows, 1)

    def count_step(self, n: int, width: int, graphed: bool, sampling: bool) -> None:
        if graphed:
            self.bucket_steps[width] = self.bucket_steps.get(width, 0) + 1
        else:
            self.eager_steps += 1
        self.sampling_steps += sampling
        self.live_rows += n
        self.padded_rows += width - n

    def count_prefill(self, width: int, graphed: bool) -> None:
        if graphed:
            self.prefill_bucket_steps[width] = self.prefill_bucket_steps.get(width, 0) + 1
        else:
            self.prefill_eager += 1

    def fresh(self) -> DecodeStats:
        """The capture facts only: the stats a new ``generate`` call starts from."""
        return DecodeStats(
            backend=self.backend,
            buckets=self.buckets,
            prefill_buckets=self.prefill_buckets,
            capture_seconds=self.capture_seconds,
            pool_bytes=self.pool_bytes,
            graph_bytes=self.graph_bytes,
        )

    def summary(self) -> str:
        """One line: tokens/s, ms per decode step and per prefill, buckets used, capture."""
        used = ", ".join(f"{b}x{n}" for b, n in sorted(self.bucket_steps.items())) or "none"
        eager = f" + {self.eager_steps} eager" if self.eager_steps else ""
        mode = self.backend or "eager (no graphs)"
        return (
            f"{self.generated_tokens} tokens in {self.total_seconds:.2f}s: "
            f"{self.tokens_per_s:.1f} tokens/s, {self.ms_per_step:.3f} ms per decode step "
            f"({self.decode_steps} steps), {self.ms_per_prefill:.3f} ms per prefill "
            f"({self.prefills}), buckets used [{used}]{eager}, padding "
            f"{100 * self.padding_waste:.0f}%, capture {self.capture_seconds:.2f}s [{mode}]"
        )
