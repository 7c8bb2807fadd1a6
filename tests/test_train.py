"""The embedded model's training pipeline: data, tokenizer, masks, a few CPU steps, checkpoint round trip."""

from __future__ import annotations

import random

import pytest
import torch

from hyserve.entrypoints.chat.k3_encoding import encode_k3
from hyserve.models.loader import load_model
from hyserve.tokenizer import load_tokenizer
from hyserve.train.bpe import save_tokenizer, train_bpe
from hyserve.train.data import (
    LOOKUP_TOOL,
    build_corpus,
    corpus_texts,
    encode_chat,
    held_out,
    split_modules,
    tool_messages,
)
from hyserve.train.trainer import TrainConfig, k3_config, new_model, save_checkpoint, train

MODULES = ["json", "textwrap"]


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(MODULES, phrasings=1)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus):
    out = str(tmp_path_factory.mktemp("tok"))
    save_tokenizer(train_bpe(corpus_texts(corpus), 600), out, 2048)
    return out


def test_corpus_is_deterministic_and_grounded_in_the_stdlib(corpus):
    again = build_corpus(MODULES, phrasings=1)
    assert again == corpus
    names = {s.name for s in corpus.symbols}
    assert "json.dumps" in names and "textwrap.dedent" in names
    dumps = next(s for s in corpus.symbols if s.name == "json.dumps")
    assert dumps.call.startswith("json.dumps(obj, *, skipkeys=False")
    assert any("def dumps(" in c for c in corpus.code)


def test_split_is_by_top_level_package():
    assert held_out("email") == held_out("email.mime") == held_out("email.utils")
    train, held = split_modules(["json", "email", "email.utils", "os.path"])
    assert sorted(train + held) == sorted(["json", "email", "email.utils", "os.path"])
    assert not set(train) & set(held)


def test_tokenizer_is_deterministic_and_loads_as_k3(corpus, tok_dir, tmp_path):
    other = str(tmp_path / "again")
    save_tokenizer(train_bpe(corpus_texts(corpus), 600), other, 2048)
    assert open(f"{tok_dir}/tokenizer.json").read() == open(f"{other}/tokenizer.json").read()
    tok = load_tokenizer(tok_dir, "k3")
    assert tok.vocab_size == 600
    for marker in ("[BOS]", "[EOS]", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOT]"):
        assert tok.special_id(marker) in tok.special_token_ids
    ids = encode_k3(tok, [{"role": "user", "content": "What does json.dumps do?"}])
    assert tok.decode(ids, skip_special_tokens=False).startswith('<|open|>message role="system"')
    assert tok.encode("<|open|>") != [tok.special_id("<|open|>")]  # typed markers stay text


def test_loss_mask_covers_exactly_the_assistant_generations(corpus, tok_dir):
    tok = load_tokenizer(tok_dir, "k3")
    sym = corpus.symbols[0]
    ids, mask = encode_chat(tok, tool_messages(sym, random.Random(0)), [LOOKUP_TOOL])
    assert len(ids) == len(mask)
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    texts = [tok.decode(s, skip_special_tokens=False) for s in spans + ([cur] if cur else [])]
    assert len(texts) == 2  # the call turn and the answer turn; never the user or tool text
    assert texts[0].startswith(f"I should look up {sym.name}.<|close|>think<|sep|>")
    assert f'key="name" type="string"<|sep|>{sym.name}<|close|>argument' in texts[0]
    assert texts[1].endswith("<|close|>message<|sep|><|end_of_msg|>") and sym.call in texts[1]


@pytest.fixture
def one_thread():
    # two busy shared cores: intra-op threads spin against each other and a step takes 100x longer
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_a_few_cpu_steps_lower_the_loss_and_the_checkpoint_round_trips(corpus, tok_dir, tmp_path, one_thread):
    tok = load_tokenizer(tok_dir, "k3")
    raw = k3_config("toy", tok.vocab_size, tok.special_id("[BOS]"), [tok.special_id("<|end_of_msg|>")], 15)
    torch.manual_seed(0)
    model = new_model(raw, "cpu")
    examples = [(ids[:48], [1] * len(ids[:48])) for ids in (tok.encode(c) for c in corpus.code[:4])]
    cfg = TrainConfig(lr=1e-2, warmup_steps=1, batch_tokens=10**6, max_steps=6, log_every=1)
    losses = train(model, examples, cfg, progress=False)
    assert losses[-1] < losses[0] - 0.3
    save_checkpoint(model, raw, tok_dir, str(tmp_path / "ckpt"), dtype=torch.float32, shard_bytes=1 << 20)
    loaded = load_model(str(tmp_path / "ckpt"))
    ids = examples[0][0][:20]
    torch.testing.assert_close(loaded.score(ids), model.score(ids))
