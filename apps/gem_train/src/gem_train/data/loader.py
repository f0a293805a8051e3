"""Rank-local training batches: a source's sub-batches, balanced by Base Batch Shuffling.

A *source* (synthetic or Parquet) serves sub-batches by index: ``source.sub_batch(k)`` is a
``Batch`` of ``data.sub_batch_size`` samples, the same on every call. Rank ``r`` of ``W`` reads
sub-batches ``r, r + W, r + 2W, ...``. Without shuffling, a local batch is the next
``batch_size / sub_batch_size`` of them, concatenated. With shuffling (``data.shuffle``, the
default), ``gem_loadbalance.BaseBatchShuffler`` assembles each local batch from a pool of read-ahead
samples so that its cost (``a·L + b·L²``, the model's per-token and per-pair FLOPs) lands on a
target every rank shares, without communication: ranks with long histories take fewer of them.

Batches are prepared ``data.prefetch`` ahead by a background thread, so the training loop finds
each one ready for the device: shuffled, padded with dummy samples for aligned low-precision GEMMs
(``lowprec.token_multiple``), packed into a reused pinned buffer when training on CUDA
(``staging.PinnedStaging``: one asynchronous copy per batch, no pinned allocation per step), and
with its host-side facts (real sample count, history lengths, longest history) already computed:
the loop does no host work on the data and never waits for the device to learn a shape. Each
is paired with the stream's state right after it, so ``state_dict()`` describes the last
batch handed to the trainer, never the read-ahead. The stream is resumable: ``load_state_dict``
followed by iteration continues with exactly the batches the uninterrupted run would have seen.
"""

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch
from gem_loadbalance.workloads import lognormal_lengths

from gem_train.config import DataConfig, ModelConfig
from gem_train.data.batch import Batch
from gem_train.data.staging import PinnedStaging, StagedBatch

_END = object()


class RankSubBatches:
    """Re-iterable: this rank's sub-batches from index 0, each an iterable of samples."""

    def __init__(self, source, *, rank: int, world: int, start: int = 0):
        self.source, self.rank, self.world, self.start = source, rank, world, start

    def __iter__(self):
        k = self.start
        while True:
            sub = self.source.sub_batch(k * self.world + self.rank)
            if sub is None:
                return
            yield _SubBatch(sub)
            k += 1


class _SubBatch:
    """A ``Batch`` seen as samples ``(batch, i)`` for the shuffler (which never looks inside)."""

    def __init__(self, batch: Batch):
        self.batch = batch

    def __iter__(self):
        return ((self.batch, i) for i in range(self.batch.num_samples))

    def lengths(self) -> np.ndarray:
        return self.batch.lengths.numpy()


def gather(samples: list[tuple[Batch, int]]) -> Batch:
    """Samples ``(batch, i)`` → one batch, in the given order (runs of one batch are selected once)."""
    parts, run_batch, run_index = [], None, []
    for batch, i in samples:
        if batch is not run_batch and run_index:
            parts.append(run_batch.select(run_index))
            run_index = []
        run_batch = batch
        run_index.append(i)
    if run_index:
        parts.append(run_batch.select(run_index))
    return Batch.cat(parts)


def cost_coefficients(m: ModelConfig) -> tuple[float, float]:
    """``(a, b)`` of ``cost = a·L + b·L²``: the model's FLOPs per token and per L² (causal pairs ≈ L²/2)."""
    d = m.d_model
    ffn = 2 * 3 * d * m.ffn_hidden if m.ffn == "swiglu" else 2 * 2 * d * m.ffn_hidden * m.top_k
    per_token = m.n_layers * (2 * 4 * d * d + ffn) + 2 * 4 * d * d  # blocks, PMA/cross K,V
    per_pair = m.n_layers * 4 * d
    return float(per_token), float(per_pair) / 2.0


@dataclass
class StepBatch:
    """One step's batch, ready for the device, and what the host knows about it.

    ``batch`` holds the ``real_samples`` real samples first, then any dummy samples that align
    its token count (``lowprec.token_multiple``; out of the loss, the metrics and the FLOPs).
    ``lengths`` are the real samples' history lengths, ``max_len`` the longest history in
    ``batch`` (a launch hint for the attention kernels). ``staged``: the batch packed into a
    pinned buffer, when it is bound for CUDA; ``to`` moves it from there.
    """

    batch: Batch
    real_samples: int
    lengths: np.ndarray
    max_len: int
    staged: StagedBatch | None = None

    @classmethod
    def of(
        cls, batch: Batch, *, token_multiple: int = 0, staging: PinnedStaging | None = None
    ) -> "StepBatch":
        lengths = batch.lengths.numpy()
        real = batch.num_samples
        if token_multiple:
            batch = batch.padded(token_multiple=token_multiple)
        max_len = int(batch.lengths.numpy().max(initial=0))
        staged = None if staging is None else staging.stage(batch)
        return cls(batch, real, lengths, max_len, staged)

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device``, without waiting for the device (from pinned memory when
        staged), with its ``layout`` checked on the host."""
        if self.staged is not None:
            return self.staged.to(device)
        return self.batch.to(device, non_blocking=True)


class TrainBatches:
    """Iterator of this rank's ``StepBatch``es; resumable through ``state_dict``."""

    def __init__(
        self, source, data: DataConfig, model: ModelConfig, *, rank: int = 0, world: int = 1,
        staging: PinnedStaging | None = None, token_multiple: int = 0,
    ):  # fmt: skip
        self.source, self.data, self.model = source, data, model
        self.rank, self.world, self.staging, self.prefetch = rank, world, staging, data.prefetch
        self.token_multiple = token_multiple
        self.shuffler = self._shuffler() if data.shuffle else None
        self._state = {"produced": 0} | (
            {"shuffler": self.shuffler.state_dict()} if self.shuffler else {}
        )
        self._iterator = None
        self._producer: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready: queue.Queue | None = None

    def _shuffler(self):
        try:
            from gem_loadbalance import BaseBatchShuffler, expected_sample_cost, sample_cost
        except ImportError as exc:
            raise RuntimeError(
                "data.shuffle=true needs gem_loadbalance.BaseBatchShuffler, which the installed "
                f"gem_loadbalance lacks ({exc}); run with --data.shuffle false"
            ) from exc
        a, b = cost_coefficients(self.model)
        d = self.data
        reference_lengths = lognormal_lengths(
            np.random.default_rng(0),
            4096,
            median=d.median_len,
            sigma=d.sigma,
            lo=d.min_len,
            hi=d.max_len,
        )
        return BaseBatchShuffler(
            RankSubBatches(self.source, rank=self.rank, world=self.world),
            sub_batch_cost=lambda sub: sample_cost(sub.lengths(), a=a, b=b),
            local_batch_size=d.batch_size,
            seed=d.seed,
            expected_cost=expected_sample_cost(reference_lengths, a=a, b=b),
        )

    def _batches(self, produced: int):
        if self.shuffler is not None:
            for samples in self.shuffler:
                yield gather(samples)
            return
        per_batch = self.data.batch_size // self.data.sub_batch_size
        start = produced * per_batch  # sub-batches are pure functions of their index
        subs = iter(RankSubBatches(self.source, rank=self.rank, world=self.world, start=start))
        while True:
            parts = [s.batch for s in (next(subs, None) for _ in range(per_batch)) if s is not None]
            if not parts:
                return
            yield Batch.cat(parts)

    def _with_states(self, produced: int):
        """``(step batch, the stream's state right after it)`` pairs."""
        for batch in self._batches(produced):
            produced += 1
            state = {"produced": produced}
            if self.shuffler is not None:
                state["shuffler"] = self.shuffler.state_dict()
            yield (
                StepBatch.of(batch, token_multiple=self.token_multiple, staging=self.staging),
                state,
            )

    def _start(self):
        pairs = self._with_states(self._state["produced"])
        if self.prefetch == 0:
            return pairs
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = self._stop

        def produce():
            # After each put the thread looks for close(): it drains the queue, so this put
            # returns, and the thread ends at the latest one batch later.
            try:
                for pair in pairs:
                    ready.put(pair)
                    if stop.is_set():
                        return
                ready.put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                ready.put(exc)

        self._ready = ready
        self._producer = threading.Thread(target=produce, name="gem-train-data", daemon=True)
        self._producer.start()

        def consume():
            while (item := ready.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return consume()

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self._iterator is None:
            self._iterator = self._start()
        batch, self._state = next(self._iterator)
        return batch

    def close(self) -> None:
        """Stop and join the prefetching thread (if one started); idempotent. A thread left
        running inside torch when the interpreter exits aborts the process ("terminate called"),
        so every run closes its batches however it ends."""
        if self._producer is None:
            return
        self._stop.set()
        while self._producer.is_alive():
            try:
                self._ready.get(timeout=0.05)  # frees the slot the producer may wait on
            except queue.Empty:
                pass
        self._producer.join()
        self._producer = None

    def state_dict(self) -> dict:
        """The position after the last batch handed out (read-ahead batches do not count)."""
        return self._state

    def load_state_dict(self, state: dict) -> None:
        """Resume after the batch ``state`` describes (before the first batch is taken).

        Raises ``RuntimeError`` once batches were taken, and ``ValueError`` for a state that is
        not a dict, lacks ``produced`` (named) or holds a negative or non-integer one, was saved
        with another ``data.shuffle``, or whose shuffler state does not match this run (the
        shuffler names the field; what needs the source, such as ``source_digest``, raises at
        the first batch).
        """
        if self._iterator is not None:
            raise RuntimeError("load_state_dict must come before the first batch is taken")
        if not isinstance(state, dict) or "produced" not in state:
            raise ValueError(
                "the checkpoint's data state is missing key 'produced' (the batches handed out)"
            )
        produced = state["produced"]
        if not isinstance(produced, int) or isinstance(produced, bool) or produced < 0:
            raise ValueError(
                f"the checkpoint's data state field 'produced' must be an integer >= 0, got "
                f"{produced!r}"
            )
        if ("shuffler" in state) != (self.shuffler is not None):
            raise ValueError(
                "the checkpoint's data state was saved with data.shuffle="
                f"{'shuffler' in state} but this run has data.shuffle={self.shuffler is not None}"
            )
        if self.shuffler is not None:
            self.shuffler.load_state_dict(state["shuffler"])
        self._state = {**state, "produced": produced}
