"""Prompts as token ids: random but reproducible, with shared prefixes.

The tiny models are random, so text means nothing to them; prompts are drawn
directly as token ids from a seeded generator. A shared-prefix workload (the
demo's) is several documents, each followed by several questions: every
question after the first on a document can reuse that document's KV.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .tiny_model import VOCAB_SIZE

FIRST_ORDINARY_TOKEN = 2  # 0 and 1 are <s> and </s>


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from a generator seeded with `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(n)]


@dataclass(frozen=True)
class SharedPrefixRequest:
    document: int
    question: int
    token_ids: list[int]
    prefix_tokens: int  # length of the shared document prefix


def shared_prefix_workload(
    documents: int, questions: int, document_tokens: int, question_tokens: int, seed: int = 0
) -> list[SharedPrefixRequest]:
    """`documents` × `questions` requests, grouped by document.

    Request (d, q) is document d's tokens followed by question q's own tokens,
    so requests of one document share exactly `document_tokens` tokens.
    """
    requests = []
    for d in range(documents):
        doc = random_tokens(document_tokens, seed * 1_000_003 + d)
        for q in range(questions):
            tail = random_tokens(question_tokens, seed * 1_000_003 + 500_000 + d * 1_000 + q)
            requests.append(SharedPrefixRequest(d, q, doc + tail, document_tokens))
    return requests
