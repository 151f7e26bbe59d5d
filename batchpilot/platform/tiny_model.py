"""A tiny random-weight Llama with a locally built tokenizer, so the live vLLM engine, the
gateway and their tests run anywhere without downloading a model.

The weights are random (fixed seed), so the text it writes is noise; what matters is that vLLM
loads it through its normal Llama path (paged attention, KV cache, scheduler) and that
``vllm serve <path>`` can serve ``/v1/completions`` and ``/v1/chat/completions`` from it.

The shape matches ``conf/model/tiny_llama.yaml`` (2 layers, hidden 128, 4 heads of 32, 2 KV
heads, MLP 512, vocabulary 1000). The tokenizer is a byte-level BPE trained on a fixed synthetic
corpus: every byte is a token, so any id sequence the random model samples decodes to text.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

#: Bumped when the files written change, so stale caches are rebuilt.
_FORMAT_VERSION = 2
_MARKER = "batchpilot-tiny-model.json"
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of the tiny model; its fingerprint names the cache folder."""

    num_layers: int = 2
    hidden_size: int = 128
    head_dim: int = 32
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1000
    max_position_embeddings: int = 2048
    dtype: str = "bfloat16"
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


def default_cache_root() -> Path:
    """``$BATCHPILOT_CACHE`` or ``<repo>/.cache`` (git-ignored)."""
    env = os.environ.get("BATCHPILOT_CACHE")
    if env:
        return Path(env)
    from batchpilot.config import REPO_ROOT

    return REPO_ROOT / ".cache"


def build_tiny_model(
    cache_dir: Path | None = None,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    head_dim: int = 32,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 2048,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Return the folder of a tiny Llama (config, safetensors, tokenizer), building it once.

    ``cache_dir`` is the model folder itself; by default ``<cache root>/tiny-llama`` for the
    default shape and ``<cache root>/tiny-llama-<fingerprint>`` for any other. An existing
    complete build with the same spec is reused; anything else is rebuilt in a temporary
    sibling folder and swapped in atomically, under a file lock so parallel builders agree.
    """
    spec = TinyModelSpec(
        num_layers=num_layers,
        hidden_size=hidden_size,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        seed=seed,
    )
    if hidden_size % head_dim != 0:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of head_dim={head_dim}")
    num_heads = hidden_size // head_dim
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if cache_dir is None:
        name = "tiny-llama" if spec == TinyModelSpec() else f"tiny-llama-{spec.fingerprint()}"
        cache_dir = default_cache_root() / name
    target = Path(cache_dir).resolve()
    if _is_complete(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, spec):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            _write_model(tmp, spec)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path, spec: TinyModelSpec) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if data.get("fingerprint") != spec.fingerprint():
        return False
    return all((folder / f).is_file() for f in data.get("files", []))


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _corpus(seed: int, num_lines: int = 2000) -> Iterator[str]:
    """Deterministic pseudo-text (syllable words, numbers, punctuation) to train the BPE on."""
    import numpy as np

    rng = np.random.default_rng(seed)
    onsets = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "st", "tr", "pl"]
    vowels = list("aeiou") + ["ai", "ea", "ou"]
    syllables = [c + v for c in onsets for v in vowels]
    punct = [".", ",", "?", "!", ":", ";"]
    for _ in range(num_lines):
        words = []
        for _ in range(rng.integers(4, 16)):
            picks = rng.integers(0, len(syllables), rng.integers(1, 4))
            word = "".join(syllables[i] for i in picks)
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.05:
                word = str(rng.integers(0, 1000))
            words.append(word)
        yield " ".join(words) + punct[rng.integers(0, len(punct))]


def _build_tokenizer(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    """Byte-level BPE trained on a fixed synthetic corpus: every byte is a token, so any id
    sequence decodes; the special tokens take ids 0..2. Training is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer reached {tok.get_vocab_size()} tokens, not vocab_size={vocab_size}; "
            "the corpus is too small for that vocabulary"
        )
    return tok


def _write_model(folder: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = _build_tokenizer(spec.vocab_size, spec.seed)
    vocab_size = spec.vocab_size
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = _CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.hidden_size // spec.head_dim,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    marker = {"fingerprint": spec.fingerprint(), "spec": asdict(spec), "files": files}
    (folder / _MARKER).write_text(json.dumps(marker, indent=2))
