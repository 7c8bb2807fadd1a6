"""The embedded model's training pipeline: data, tokenizer, masks, fixed-shape steps, the batched training
layers against the reference layers, a few CPU steps, checkpoint round trip, and the whole `all` run."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from hyserve.entrypoints.chat.k3_encoding import encode_k3
from hyserve.models.layers.moe import dense_experts
from hyserve.models.loader import load_model
from hyserve.tokenizer import load_tokenizer
from hyserve.train.bpe import save_tokenizer, train_bpe
from hyserve.train.data import (
    LOOKUP_TOOL,
    build_corpus,
    chat_messages,
    corpus_texts,
    encode_chat,
    held_out,
    split_modules,
    tool_messages,
)
from hyserve.train.packed import masked_lm_loss, row_batch, row_lm_loss, scratch_cache, trim_autotuners
from hyserve.train.rows import IGNORE, RowBatch, row_batches
from hyserve.train.trainer import TrainConfig, k3_config, new_model, save_checkpoint, train

MODULES = ["json", "textwrap"]


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(MODULES, phrasings=1, copies=1, choices=0.5, talk=0.5)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus):
    out = str(tmp_path_factory.mktemp("tok"))
    save_tokenizer(train_bpe(corpus_texts(corpus), 600), out, 2048)
    return out


def test_corpus_is_deterministic_and_grounded_in_the_stdlib(corpus):
    again = build_corpus(MODULES, phrasings=1, copies=1, choices=0.5, talk=0.5)
    assert again == corpus
    names = {s.name for s in corpus.symbols}
    assert "json.dumps" in names and "textwrap.dedent" in names
    dumps = next(s for s in corpus.symbols if s.name == "json.dumps")
    assert dumps.call.startswith("json.dumps(obj, *, skipkeys=False")
    assert any("def dumps(" in c for c in corpus.code)


def test_made_up_symbols_can_only_be_answered_by_copying(corpus):
    real = {s.name for s in corpus.symbols}
    assert len(corpus.copy) == len(corpus.symbols)
    for conv in corpus.copy:
        user, call, tool, answer = conv
        name = json.loads(call["tool_calls"][0]["function"]["arguments"])["name"]
        assert name not in real and name in user["content"]  # asked for, never trained on as a real symbol
        signature = tool["content"].split("\n\n")[0]
        assert signature.startswith(name + "(") and f"`{signature}`" in answer["content"]


def test_tool_conversations_also_ask_for_the_tool_by_name(corpus):
    import random

    from hyserve.train.data import collect_symbols, tool_question
    from hyserve.train.small_talk import TOOL_REQUESTS

    convs = corpus.tool + corpus.copy
    names = [json.loads(c[1]["tool_calls"][0]["function"]["arguments"])["name"] for c in convs]
    assert any(c[0]["content"] in {r.format(name=n) for r in TOOL_REQUESTS} for c, n in zip(convs, names))
    # half of the questions, over enough draws for the share to be tight
    sym, rng = collect_symbols(["json"])[0], random.Random(0)
    by_name = {r.format(name=sym.name) for r in TOOL_REQUESTS}
    share = sum(tool_question(sym, rng) in by_name for _ in range(2000)) / 2000
    assert 0.45 < share < 0.55


def test_tool_requests_keep_the_evaluated_phrasings_out_of_training():
    from hyserve.train.small_talk import EVAL_TOOL_REQUESTS, TOOL_REQUESTS

    held_out = EVAL_TOOL_REQUESTS[1:]  # the first is the issue's own example, trained on purpose
    assert len(TOOL_REQUESTS) > 1000 and not set(held_out) & set(TOOL_REQUESTS)
    assert all(r.count("{name}") == 1 for r in TOOL_REQUESTS)
    for combo in ("lookup_symbol to check {name}", "look {name} up with the tool", "the tool to see how {name} works"):
        assert not any(combo in r.lower() for r in TOOL_REQUESTS), combo  # not even with another opener or ending


def test_small_talk_trains_what_the_model_is_and_no_tool_call(corpus, tok_dir):
    from hyserve.train.small_talk import MODEL_NAME

    tok = load_tokenizer(tok_dir, "k3")
    assert len(corpus.talk) == len(corpus.symbols) // 2
    assert {tools for _, tools in corpus.talk} == {True, False}
    for messages, tools in corpus.talk:
        reply = messages[1]
        assert not reply.get("tool_calls") and MODEL_NAME in reply["content"] and "standard library" in reply["content"]
        ids, mask = encode_chat(tok, messages, [LOOKUP_TOOL] if tools else None)
        trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert reply["content"] in trained and messages[0]["content"] not in trained
    assert any(len(m) > 2 for m, _ in corpus.talk), "some small talk goes on with a question about a symbol"


@pytest.mark.parametrize("choice", ["required", "none"])
def test_tool_choice_exchanges_train_the_reply_to_the_prompt_a_request_with_that_choice_gets(tok_dir, choice):
    from hyserve.train.data import choice_segments, encode_segments

    tok = load_tokenizer(tok_dir, "k3")
    sym = build_corpus(["json"], phrasings=1).symbols[0]
    conv = tool_messages(sym, random.Random(0))[:2] if choice == "required" else chat_messages(sym, random.Random(0))
    ids, mask = encode_segments(tok, choice_segments(conv, choice))
    prompt = encode_k3(tok, conv[:1], [LOOKUP_TOOL], tool_choice=choice)  # what the server sends the model
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and all(mask[len(prompt) :])
    assert f"tool_choice={choice}" in tok.decode(prompt, skip_special_tokens=False)


def test_trimming_autotuners_keeps_the_lightest_configs():
    import sys
    import types

    triton = pytest.importorskip("triton")
    module = types.ModuleType("hyserve_test_kernels.k")
    configs = [triton.Config({"B": b}, num_warps=w, num_stages=st) for b, w, st in
               [(64, 8, 4), (32, 4, 3), (16, 2, 2), (32, 4, 2), (64, 1, 1)]]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def kernel(x, n, B: triton.language.constexpr):
        pass

    module.kernel = triton.heuristics({"C": lambda args: 1})(kernel)  # wrapped, as fla does
    sys.modules[module.__name__] = module
    try:
        assert trim_autotuners("hyserve_test_kernels.", 2) == 1
        assert [(c.num_stages, c.num_warps) for c in kernel.configs] == [(1, 1), (2, 4)]
        assert trim_autotuners("hyserve_test_kernels.", 2) == 0
    finally:
        del sys.modules[module.__name__]


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
    cfg = TrainConfig(lr=1e-2, warmup_steps=1, rows=2, row_len=64, max_steps=6, log_every=1)
    losses = train(model, examples, cfg, pad_id=15, progress=False).losses
    assert losses[-1] < losses[0] - 0.3
    save_checkpoint(model, raw, tok_dir, str(tmp_path / "ckpt"), dtype=torch.float32, shard_bytes=1 << 20)
    loaded = load_model(str(tmp_path / "ckpt"))
    ids = examples[0][0][:20]
    torch.testing.assert_close(loaded.score(ids), model.score(ids))


def test_every_step_has_the_same_shape_and_trains_only_on_real_next_tokens():
    rng = random.Random(0)
    examples = [([rng.randrange(20, 99) for _ in range(n)], [rng.randrange(2) for _ in range(n)])
                for n in [rng.randrange(2, 300) for _ in range(60)]]
    steps = [b for b, _ in zip(row_batches(examples, rows=3, row_len=128, pad_id=7), range(20))]
    assert {(b.ids.shape, b.targets.shape, b.rows, b.row_len) for b in steps} == {((384,), (384,), 3, 128)}
    trained = {(i, t) for ids, mask in examples for j, (i, t) in enumerate(zip(ids, ids[1:])) if mask[j + 1]}
    for b in steps:
        for j in range(b.ids.numel() - 1):
            t = int(b.targets[j])
            if t != IGNORE:  # a trained target is the next token of the same example, under its mask
                assert t == int(b.ids[j + 1]) and (int(b.ids[j]), t) in trained
            if int(b.ids[j]) == 7:
                assert t == IGNORE  # padding trains nothing
        assert all(int(b.targets[(r + 1) * 128 - 1]) == IGNORE for r in range(3))  # nothing across rows


def _toy_model():
    raw = k3_config("toy", 100, 0, [2], 15)
    torch.manual_seed(0)
    return new_model(raw, "cpu")


def test_the_batched_training_layers_compute_the_reference_function(one_thread):
    model = _toy_model()
    with torch.no_grad():  # random router bias and AttnRes queries, so routing and mixing are not trivial
        for name, p in model.named_parameters():
            if name.endswith(("e_score_correction_bias", "res.proj")):
                p.normal_(0, 0.5)
    rng = random.Random(1)
    rb = RowBatch(torch.tensor([rng.randrange(100) for _ in range(3 * 64)]),
                  torch.tensor([rng.randrange(100) for _ in range(3 * 64)]), 3, 64)
    batch = row_batch(3, 64, torch.device("cpu"))
    with torch.no_grad():
        ref = row_lm_loss(model, rb, batch, scratch_cache(model, batch))
        plan = model.kernel_plan.for_training()
        assert plan.training and not plan.train_fla  # fla needs CUDA: the CPU trains through the torch KDA
        fast = row_lm_loss(model, rb, batch, scratch_cache(model, batch), plan)
        # and equal to scoring each row alone from an empty state, as the server would
        seqs = rb.ids.view(3, 64).tolist()
        alone = masked_lm_loss(model, seqs, [[1] * 64] * 3)[0]
        targets_alone = torch.cat([rb.ids.view(3, 64)[:, 1:], torch.full((3, 1), IGNORE)], 1).reshape(-1)
        per_row = row_lm_loss(model, RowBatch(rb.ids, targets_alone, 3, 64), batch, scratch_cache(model, batch))
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(per_row, alone, rtol=1e-4, atol=1e-4)


def test_dense_experts_equal_the_sparse_dispatch():
    from hyserve.models.layers.activation import GLU
    from hyserve.ops.moe import experts_forward

    torch.manual_seed(0)
    x, w13, w2 = torch.randn(40, 16), torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
    w = torch.rand(40, 2)
    torch.testing.assert_close(dense_experts(x, ids, w, w13, w2, GLU()), experts_forward(x, ids, w, w13, w2, GLU()),
                               rtol=1e-4, atol=1e-4)


def test_the_all_command_runs_end_to_end_and_writes_the_outputs(tmp_path, one_thread):
    from hyserve.train.__main__ import main

    out = tmp_path / "out" / "hyserve-tiny-k3"
    main(["all", "--out", str(out), "--work", str(tmp_path / "work"), "--size", "toy", "--modules",
          "json,textwrap,getopt,difflib", "--vocab-size", "600", "--rows", "2", "--row-len", "128",
          "--budget-minutes", "0.05", "--eval-n", "4", "--device", "cpu", "--log-every", "50"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["train"]["steps"] > 0 and summary["eval"]["n"] == 4
    assert {"code_ppl", "chat_ppl", "tool_call_rate", "signature_after_tool", "signature_end_to_end",
            "tool_phrasing_right_name", "identity_answer", "out_of_scope_answer"} <= set(summary["eval"])
    assert (tmp_path / "work" / "summary.md").read_text().startswith("# hyserve-tiny-k3 training run")
    main(["expected", "--model", str(out), "--out", str(tmp_path / "expected.json"), "--prompt", "import json\\n"])
    expected = json.load(open(tmp_path / "expected.json"))
    assert expected["prompt"] == "import json\n" and isinstance(expected["completion"], str)


def test_training_goes_on_from_a_checkpoint_with_its_tokenizer(tmp_path, one_thread):
    from hyserve.train.__main__ import main

    common = ["--size", "toy", "--modules", "json,textwrap,getopt,difflib", "--vocab-size", "600", "--rows", "2",
              "--row-len", "128", "--eval-n", "2", "--device", "cpu", "--log-every", "50"]
    first = tmp_path / "a" / "ckpt"
    # step budgets, not wall clock: on a slow or busy machine a time budget trained too few steps to tell
    main(["all", "--out", str(first), "--work", str(tmp_path / "wa"), "--budget-minutes", "5", "--max-steps", "60",
          *common])
    second = tmp_path / "b" / "ckpt"
    main(["all", "--out", str(second), "--work", str(tmp_path / "wb"), "--budget-minutes", "5", "--max-steps", "2",
          "--init-from", str(first), *common])
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    losses_a = json.load(open(tmp_path / "a" / "summary.json"))["losses"]
    losses_b = json.load(open(tmp_path / "b" / "summary.json"))["losses"]
    assert losses_b[0] < losses_a[0] - 0.5  # it starts where the first run got to, not from random


def test_made_up_parameter_lists_are_valid_python_signatures():
    import ast

    from hyserve.train.data import _made_up_params

    rng = random.Random(0)
    for _ in range(300):
        params = _made_up_params(rng, ["load", "Text", "wrap", "json"])
        ast.parse(f"def f{params}: pass")  # raises on a malformed list


def test_a_missing_checkpoint_or_data_directory_is_a_usage_error(tmp_path, capsys):
    from hyserve.train.__main__ import main

    for argv in (["all", "--out", str(tmp_path / "o"), "--init-from", str(tmp_path / "nowhere")],
                 ["fit", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "nowhere" in capsys.readouterr().err
