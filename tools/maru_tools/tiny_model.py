"""Build a small randomly initialised Llama and a byte-level BPE tokenizer.

No model can be downloaded where MaruCache is tested, so the end-to-end tests,
the demo and the benchmark build one locally. The weights are random but
deterministic (fixed seed), which is all that hit-versus-recompute comparisons
need: greedy decoding of the same model on the same prompt is reproducible,
and KV loaded from the pool must give exactly the tokens a recompute gives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 1024  # byte-level BPE: 256 bytes + merges + specials


@dataclass(frozen=True)
class TinyModelSpec:
    """The geometry of a tiny Llama. A different seed gives a different model."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 8192
    seed: int = 0
    # float32: a split prefill and a whole one agree except on true ties, so
    # greedy tokens are an oracle (bf16 near-ties flip with batching), and
    # vLLM's CPU kernels run it faster than bf16 on CPUs without AMX.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"num_heads*head_dim ({self.num_heads}*{self.head_dim}) must equal "
                f"hidden_size ({self.hidden_size})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def fingerprint(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


# A model whose prefill dominates a CPU step: used by the TTFT benchmark.
BENCH_SPEC = TinyModelSpec(
    hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=64,
    intermediate_size=2816, seed=0,
)

_TOKENIZER_CORPUS = (
    "The shared key-value cache lets one engine reuse the prefill of another. "
    "Documents, questions and answers are split into tokens; every token has an id. "
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?()[]{}'\"-_/ "
)


def default_cache_dir() -> Path:
    """Where built models are kept between runs of one machine."""
    base = os.environ.get("MARUCACHE_MODEL_CACHE") or os.path.join(
        tempfile.gettempdir(), "marucache-models"
    )
    return Path(base)


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out_dir))


def _build_weights(spec: TinyModelSpec, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    # Wider random weights than the default init, so that greedy decoding
    # depends on the whole context instead of collapsing onto one token.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 * 4)
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(out_dir), safe_serialization=True)


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return a directory holding the model of `spec`, building it on first use.

    The directory is named after the spec's fingerprint, so every spec is built
    once per cache directory; a half-built directory is never returned (the
    build happens in a temporary sibling that is renamed when complete).
    """
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / f"tiny-llama-{spec.fingerprint()}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=cache_dir))
    _build_weights(spec, staging)
    _build_tokenizer(staging)
    try:
        os.rename(staging, target)
    except OSError:
        # Another process finished the same build first; theirs is identical.
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target
