"""A seeded, resumable iterator over prompt batches (epoch-wise permutations)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qerl_jax.data.sources import Example


class PromptIterator:
    """Yields batches of examples; the order of epoch e is permutation(seed, e).

    `position` (epoch, index) is all the state there is: save it in a checkpoint and pass it
    back to resume exactly where the run stopped.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int,
                 position: tuple[int, int] = (0, 0)):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples are fewer than one batch of "
                             f"{batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch, self.index = position

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.index

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def next_batch(self) -> list[Example]:
        if self.index + self.batch_size > len(self.examples):
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order(self.epoch)
        batch = [self.examples[i] for i in order[self.index:self.index + self.batch_size]]
        self.index += self.batch_size
        return batch
