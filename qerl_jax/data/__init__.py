"""Prompts and gold answers: local jsonl/parquet or hub datasets, chat-templated prompts,
left-padded batches and a resumable, seeded iterator."""

from qerl_jax.data.prompts import PromptBatch, encode_prompts
from qerl_jax.data.sources import Example, load_examples
from qerl_jax.data.iterator import PromptIterator

__all__ = ["PromptBatch", "encode_prompts", "Example", "load_examples", "PromptIterator"]
