"""`hyserve generate`: prompts in, text or JSON lines out, clear errors and exit codes on bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from hyserve.entrypoints.generate import add_generate_parser, run_generate


def generate(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", *argv])
    return run_generate(args)


SMALL = ("--device", "cpu", "--block-size", "16", "--max-tokens", "4", "--temperature", "0")


def test_jsonl_output_has_one_line_per_prompt_with_the_documented_fields(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n\nworld, again\n")
    assert generate("--prompts-file", str(path), "--output", "jsonl", "--ignore-eos", *SMALL) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello", "world, again"]
    assert {"prompt", "text", "token_ids", "finish_reason", "num_cached_tokens"} <= set(rows[0])
    assert all(len(r["token_ids"]) == 4 and r["finish_reason"] == "length" for r in rows)


def test_model_defaults_to_the_embedded_default_model(capsys):
    assert generate("--prompt", "hi", *SMALL) == 0
    out = capsys.readouterr().out
    assert "# prompt 0: 'hi'" in out and "# completion 0" in out


def test_jsonl_prompts_file_accepts_strings_and_prompt_objects(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"first"\n{"prompt": "second"}\n')
    assert generate("--prompts-file", str(path), "--output", "jsonl", *SMALL) == 0
    assert [json.loads(x)["prompt"] for x in capsys.readouterr().out.splitlines()] == ["first", "second"]


def test_n_prints_each_completion(capsys):
    assert generate("--prompt", "hi", "--n", "2", "--output", "jsonl", *SMALL) == 0
    assert [json.loads(x)["index"] for x in capsys.readouterr().out.splitlines()] == [0, 1]


def test_missing_prompts_file_is_a_clear_error(tmp_path, capsys):
    assert generate("--prompts-file", str(tmp_path / "nope.txt"), *SMALL) == 2
    assert "nope.txt" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, field", [("--top-p", "0", "top_p"), ("--n", "0", "n")])
def test_bad_sampling_parameter_is_a_clear_error(capsys, flag, value, field):
    assert generate("--prompt", "hi", *SMALL, flag, value) == 2
    assert field in capsys.readouterr().err


def test_a_rejected_prompt_is_reported_and_fails_the_run(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("ok\n" + "x" * 100 + "\n")
    assert generate("--prompts-file", str(path), "--max-model-len", "32", "--output", "jsonl", *SMALL) == 1
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in captured.out.splitlines()]
    assert rows[0].get("error") is None and "max_model_len" in rows[1]["error"]
    assert "max_model_len" in captured.err
