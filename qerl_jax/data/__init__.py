"""Prompts and gold answers: rows of local jsonl/parquet files or hub datasets, the built-in
tasks' gold parsers and generated problems, chat-templated prompts, left-padded batches and a
resumable, seeded iterator. Which task a row belongs to is `qerl_jax.tasks`'."""

from qerl_jax.data.prompts import PromptBatch, encode_prompts
from qerl_jax.data.sources import Example
from qerl_jax.data.iterator import PromptIterator

__all__ = ["PromptBatch", "encode_prompts", "Example", "PromptIterator"]
