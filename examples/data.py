"""Synthetic packed documents for the training examples: multi-query associative recall (numpy only).

Each document lists key-value pairs, then asks for some of the keys again; the model must answer
with the value that followed the key earlier in the *same* document. Documents are packed into
one row of T tokens; what is left at the end is padding (doc id 0). Only the answers count in
the loss, so chance level is log(num_values) once the model knows answers are values, and the loss
falls below it only by recalling. Token ids::

    0 pad   1 bos   2 sep   3 .. 3+K-1 keys   3+K .. 3+K+V-1 values
    doc:    bos k1 v1 k2 v2 k3 v3 sep k2 v2 k1 v1        targets: the v after each query key
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD, BOS, SEP = 0, 1, 2
IGNORE = -100


@dataclass(frozen=True)
class RecallTask:
    num_keys: int = 8
    num_values: int = 8
    min_pairs: int = 2
    max_pairs: int = 6
    queries: int = 4

    @property
    def vocab_size(self) -> int:
        return 3 + self.num_keys + self.num_values

    @property
    def max_document_len(self) -> int:
        return 2 + 2 * self.max_pairs + 2 * min(self.queries, self.max_pairs)

    @property
    def min_document_len(self) -> int:
        return 2 + 2 * self.min_pairs + 2 * min(self.queries, self.min_pairs)

    def document(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n], targets [n]) of one document; targets[i] is what token i should predict."""
        pairs = int(rng.integers(self.min_pairs, self.max_pairs + 1))
        keys = 3 + rng.choice(self.num_keys, size=pairs, replace=False)
        values = 3 + self.num_keys + rng.integers(0, self.num_values, size=pairs)
        asked = rng.choice(pairs, size=min(self.queries, pairs), replace=False)
        context = np.stack([keys, values], axis=1).reshape(-1)
        questions = np.stack([keys[asked], values[asked]], axis=1).reshape(-1)
        tokens = np.concatenate([[BOS], context, [SEP], questions])
        targets = np.full(tokens.shape, IGNORE)
        answer_at = 1 + context.size + 1 + 2 * np.arange(asked.size)  # each query key predicts its value
        targets[answer_at] = tokens[answer_at + 1]
        return tokens, targets


def packed_batch(task: RecallTask, rng: np.random.Generator, total_len: int):
    """One packed row: (input_ids int64 [T], targets int64 [T], doc_ids int64 [T], 0 = padding)."""
    tokens = np.full(total_len, PAD, np.int64)
    targets = np.full(total_len, IGNORE, np.int64)
    doc_ids = np.zeros(total_len, np.int64)
    cursor, doc = 0, 1
    while True:
        doc_tokens, doc_targets = task.document(rng)
        if cursor + doc_tokens.size > total_len:
            break
        tokens[cursor:cursor + doc_tokens.size] = doc_tokens
        targets[cursor:cursor + doc_tokens.size] = doc_targets
        doc_ids[cursor:cursor + doc_tokens.size] = doc
        cursor += doc_tokens.size
        doc += 1
    return tokens, targets, doc_ids


__all__ = ["IGNORE", "RecallTask", "packed_batch"]
