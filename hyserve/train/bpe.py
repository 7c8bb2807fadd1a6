"""Byte-level BPE for the embedded model, trained with HF `tokenizers` and saved in the layout
`hyserve.tokenizer.load_tokenizer(model_dir, "k3")` reads (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from hyserve.tokenizer import K3_SPECIAL_TOKENS

NUM_RESERVED = 5  # spare specials, so a later format change need not resize the embedding


def special_tokens() -> list[str]:
    """K3's named markers (ids 0..10, in the real checkpoint's relative order), then reserved ones."""
    return list(K3_SPECIAL_TOKENS) + [f"<|reserved_token_{i}|>" for i in range(NUM_RESERVED)]


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer`; deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens(), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                  "normalized": False, "single_word": False}
        for t in special_tokens()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
