"""A byte-level BPE tokenizer, trained here on the training split (Hugging Face ``tokenizers``).

Byte-level means no unknown token: any UTF-8 text, code included, round-trips.
It is saved as ``tokenizer.json`` beside the checkpoint, so a resumed or
evaluated model reads text exactly as it was trained on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["EOS", "PAD", "load_tokenizer", "train_tokenizer"]

EOS = "<|endoftext|>"
PAD = "<|pad|>"
TOKENIZER_FILE = "tokenizer.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learn a byte-level BPE of ``vocab_size`` entries (the 256 bytes and EOS/PAD included)."""
    if vocab_size < 260:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens plus specials")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: code and text are tokenized as they are, byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
    return Tokenizer.from_file(str(path))


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Atomic, like every other artefact: a killed save leaves the old file or none."""
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)
    return path
