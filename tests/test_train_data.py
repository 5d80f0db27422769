"""Training data pipeline: assistant masks (ChatML and Llama-3 templates), input shapes, truncation, sharding,
draft vocabulary, held-out guard and Magpie prompts. CPU only; uses the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import real_model_or_skip
from train import data, vocab
from train.data import (
    HeldoutLeakError,
    MaskStats,
    assert_no_heldout,
    assistant_mask,
    build_dataset,
    load_conversations,
    magpie_prompts,
    normalize_conversation,
    training_prompts,
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _load_smol_tokenizer():
    from transformers import AutoTokenizer

    from ssd_eagle.assets import DEFAULT_MODEL, resolve_model_path

    with real_model_or_skip():  # the packaged model is missing: a failure under CI=true, else a skip
        return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def smol():
    return _load_smol_tokenizer()


@pytest.fixture(scope="module")
def llama3():
    tok = _load_smol_tokenizer()  # a separate instance: SmolLM2's BPE with Llama-3 special tokens and template
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


EOT = {"smol": "<|im_end|>", "llama3": "<|eot_id|>"}


def masked_runs(tokenizer, sample) -> list[str]:
    """Decoded contiguous runs of masked tokens (one per assistant turn)."""
    runs, current = [], []
    for tok, m in zip(sample["input_ids"], sample["loss_mask"]):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


TRICKY = conv(
    ("system", "You answer briefly."),
    ("user", "Say the word assistant."),
    ("assistant", "assistant"),  # also part of every assistant header
    ("user", "Now repeat what I said: Say the word assistant."),
    ("assistant", "Say the word assistant."),  # also an earlier user message
    ("user", "Unicode?"),
    ("assistant", "Oui, ça marche 🙂 — 東京.\nLine two.\n"),
)


@pytest.mark.parametrize("which", ["smol", "llama3"])
@pytest.mark.parametrize("messages", [
    conv(("user", "Hi!"), ("assistant", "Hello, how can I help you today?")),
    conv(("system", "Be nice."), ("user", "What is 2+2?"), ("assistant", "2+2 is 4."),
         ("user", "And 3+3?"), ("assistant", "3+3 is 6.")),
    TRICKY,
], ids=["single", "multi_system", "tricky"])
def test_mask_covers_exactly_assistant_turns(request, which, messages):
    tok = request.getfixturevalue(which)
    stats = MaskStats()
    sample = assistant_mask(messages, tok, stats=stats)
    assert len(sample["input_ids"]) == len(sample["loss_mask"]) and not sample["truncated"]
    expected = [m["content"].strip() if which == "llama3" else m["content"]
                for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, sample) == [c + EOT[which] for c in expected]
    # the tokens are the template's own tokenization (header excluded from the mask, BOS written once)
    assert sample["input_ids"] == tok(tok.apply_chat_template(messages, tokenize=False),
                                      add_special_tokens=False)["input_ids"]
    assert stats.num_assistant_turns == len(expected) and stats.num_loss_tokens == sum(sample["loss_mask"])


def test_role_header_excluded_and_eot_included(smol):
    sample = assistant_mask(conv(("user", "Hi"), ("assistant", "Yo")), smol)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    first = mask.index(1)
    assert smol.decode(ids[:first]).endswith("<|im_start|>assistant\n")  # header right before, unmasked
    assert smol.convert_ids_to_tokens(ids[max(i for i, m in enumerate(mask) if m)]) == "<|im_end|>"
    assert mask[-1] == 0  # the newline after <|im_end|> is not the assistant's


def test_llama3_trimmed_content_and_prompt_only(llama3):
    sample = assistant_mask(conv(("user", "  q  "), ("assistant", "\n  answer with spaces \n")), llama3)
    assert masked_runs(llama3, sample) == ["answer with spaces<|eot_id|>"]
    assert llama3.decode(sample["input_ids"][:1]) == "<|begin_of_text|>"
    # "Hi " is trimmed to "Hi" in its own turn; the untrimmed text only occurs later, in a user turn
    sample = assistant_mask(conv(("user", "q"), ("assistant", "Hi "), ("user", "Hi there"), ("assistant", "ok")), llama3)
    assert masked_runs(llama3, sample) == ["Hi<|eot_id|>", "ok<|eot_id|>"]
    prompt_only = assistant_mask(conv(("user", "just a prompt")), llama3)
    assert sum(prompt_only["loss_mask"]) == 0


def test_conversation_opening_with_assistant(smol):
    # the generation-prompt prefix of [] is not a prefix of the rendering (SmolLM2 adds a default system turn):
    # the search falls back to the in-order cursor
    messages = conv(("assistant", "I start."), ("user", "ok"), ("assistant", "fine"))
    assert masked_runs(smol, assistant_mask(messages, smol)) == ["I start.<|im_end|>", "fine<|im_end|>"]


def test_empty_assistant_content_masks_only_end_of_turn(smol):
    sample = assistant_mask(conv(("user", "q"), ("assistant", ""), ("user", "again"), ("assistant", "x")), smol)
    assert masked_runs(smol, sample) == ["<|im_end|>", "x<|im_end|>"]


def test_template_that_rewrites_content_raises(smol):
    upper = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].upper()"
             " + '<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot be located"):
        assistant_mask(conv(("user", "hi"), ("assistant", "hello there")), smol, chat_template=upper)


def test_template_without_end_of_turn_raises(smol):
    no_eot = "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    with pytest.raises(ValueError, match="end-of-turn"):
        assistant_mask(conv(("user", "hi"), ("assistant", "hello there")), smol, chat_template=no_eot)


def test_truncation_is_counted(smol):
    long_conv = conv(("user", "Count."), ("assistant", " ".join(str(i) for i in range(300))))
    stats = MaskStats(max_length=64)
    sample = assistant_mask(long_conv, smol, max_length=64, stats=stats)
    assert sample["truncated"] and len(sample["input_ids"]) == len(sample["loss_mask"]) == 64
    assert stats.num_truncated == 1 and stats.num_tokens == 64
    short = assistant_mask(conv(("user", "a"), ("assistant", "b")), smol, max_length=64, stats=stats)
    assert not short["truncated"] and stats.num_truncated == 1 and stats.num_conversations == 2


# ---------------------------------------------------------------------------------------------------------------
# input shapes and loading

SHAREGPT_ROW = {"id": "s0", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                                               {"from": "gpt", "value": "a1"}, {"from": "user", "value": "q2"},
                                               {"from": "assistant", "value": "a2"}]}
OPENAI_ROW = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_three_input_shapes():
    assert normalize_conversation(SHAREGPT_ROW) == conv(("system", "sys"), ("user", "q1"), ("assistant", "a1"),
                                                        ("user", "q2"), ("assistant", "a2"))
    assert normalize_conversation(OPENAI_ROW) == conv(("user", "q"), ("assistant", "a"))
    assert normalize_conversation({"prompt": "p"}) == conv(("user", "p"))
    assert normalize_conversation({"text": "t", "messages": None}) == conv(("user", "t"))
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert normalize_conversation(parts) == conv(("user", "ab"))


@pytest.mark.parametrize("row, match", [
    ({"question": "?"}, "row 7: unknown conversation shape"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, r"row 7: field 'conversations\[0\].from'.*'bot'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, r"row 7: field 'messages\[0\].role'.*'tool'"),
    ({"messages": [{"role": "user"}]}, r"row 7: field 'messages\[0\]' needs"),
])
def test_unknown_shapes_and_roles_raise(row, match):
    with pytest.raises(ValueError, match=match):
        normalize_conversation(row, 7)


def test_load_local_json_and_jsonl(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [SHAREGPT_ROW, {"prompt": "only"}]) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([OPENAI_ROW]))
    convs = load_conversations(tmp_path)  # folder: both files, mixed shapes (datasets fills missing fields with None)
    assert [c["messages"] for c in convs] == [normalize_conversation(SHAREGPT_ROW), conv(("user", "only")),
                                              normalize_conversation(OPENAI_ROW)]
    assert convs[0]["id"] == "s0"
    assert len(load_conversations(tmp_path / "b.json")) == 1
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:0: unknown conversation shape"):
        load_conversations(tmp_path / "bad.jsonl")


def test_hub_id_not_available_locally_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        load_conversations("no-such-owner/no-such-dataset-ssd-eagle")


# ---------------------------------------------------------------------------------------------------------------
# dataset and sharding

def test_build_dataset_shards_are_disjoint_and_cover(smol):
    convs = [conv(("user", f"Question {i}?"), ("assistant", f"Answer number {i}.")) for i in range(10)]
    convs.append(conv(("user", "prompt only")))  # dropped: nothing to learn
    full, stats = build_dataset(convs, smol, max_length=64, progress=False)
    assert stats.num_conversations == 11 and stats.num_dropped_no_loss == 1 and len(full) == 10
    assert set(full.column_names) == {"input_ids", "loss_mask", "length"}
    row = full[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"]
    keys = lambda ds: [tuple(r) for r in ds["input_ids"]]  # noqa: E731
    shards = [build_dataset(convs, smol, max_length=64, rank=r, world_size=3, progress=False)[0] for r in range(3)]
    assert sorted(len(s) for s in shards) == [3, 3, 4]
    union = [k for s in shards for k in keys(s)]
    assert len(union) == len(set(union)) and sorted(union) == sorted(keys(full))
    with pytest.raises(ValueError, match="rank"):
        build_dataset(convs, smol, rank=3, world_size=3, progress=False)


def test_build_dataset_counts_truncation_and_refuses_heldout(smol, tmp_path):
    convs = [conv(("user", "x"), ("assistant", "word " * 200)), conv(("user", "y"), ("assistant", "ok"))]
    ds, stats = build_dataset(convs, smol, max_length=48, progress=False)
    assert stats.num_truncated == 1 and max(ds["length"]) == 48
    from ssd_eagle.prompts import mtbench_questions

    leak = [conv(("user", mtbench_questions()[0]["turns"][0]), ("assistant", "sure"))]
    with pytest.raises(HeldoutLeakError):
        build_dataset(leak, smol, progress=False)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    assert len(build_dataset(str(path), smol, progress=False)[0]) == 1


# ---------------------------------------------------------------------------------------------------------------
# held-out guard and training prompts

def test_assert_no_heldout_catches_mtbench_and_humaneval():
    from ssd_eagle.prompts import humaneval_problems, mtbench_questions

    question = mtbench_questions()[5]["turns"][1]
    wrapped = "Please help.\n" + "  ".join(question.split(" ")) + "\nThanks"  # substring, other whitespace
    with pytest.raises(HeldoutLeakError, match="mtbench/"):
        assert_no_heldout([conv(("user", "fine")), conv(("user", wrapped))])
    with pytest.raises(HeldoutLeakError, match="HumanEval/4"):
        assert_no_heldout(["Complete this Python function.\n\n" + humaneval_problems()[4]["prompt"]])
    assert_no_heldout(["Complete this Python function.\n\n" + humaneval_problems()[5]["prompt"],
                       {"turns": ["hello"]}, conv(("user", "hi"), ("assistant", "hello"))])


def test_training_prompts_sources():
    prompts = training_prompts(["Write a haiku.", "write a  haiku."])
    by_source = {}
    for p in prompts:
        by_source.setdefault(p["source"], []).append(p)
    assert len(by_source["humaneval"]) == 123  # 164 problems minus 41 held out
    assert all(int(p["id"].split("/")[1]) % 4 for p in by_source["humaneval"])
    assert by_source["sharegpt"] and all(p["turns"] for p in by_source["sharegpt"])
    assert len({tuple(p["turns"]) for p in by_source["sharegpt"]}) == len(by_source["sharegpt"])
    assert [p["turns"] for p in by_source["extra"]] == [["Write a haiku."]]
    assert_no_heldout(prompts)


def test_magpie_prompts_stops_dedups_and_filters(smol):
    from ssd_eagle.prompts import mtbench_questions

    end = smol.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: smol(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    scripted = [
        enc("How do rainbows form?") + [end] + enc("ignored after the stop"),
        enc("how do  rainbows form?") + [end],  # duplicate (case/whitespace)
        [end],  # empty
        enc("Unfinished question without an end"),  # no stop token
        enc("spam " * 20) + [end],  # degenerate
        enc(mtbench_questions()[0]["turns"][0]) + [end],  # held out
        enc("Explain recursion to a child.") + [end],
        enc("<|im_start|>assistant\nHi") + [end],  # special-token text
    ]
    calls = []

    def generate_fn(prefixes, max_tokens, temperature, seed):
        calls.append((prefixes, max_tokens, temperature, seed))
        return [scripted.pop(0) if scripted else [end] for _ in prefixes]

    result = magpie_prompts(smol, generate_fn, 3, batch_size=4, max_rounds=3, progress=False)
    assert result.prompts == ["How do rainbows form?", "Explain recursion to a child."]
    assert (result.num_duplicate, result.num_unfinished, result.num_heldout) == (1, 1, 1)
    assert result.num_degenerate == 3 + 4  # empty, spam, special text, then the [end]-only rows of round 3
    prefix_text = smol.decode(calls[0][0][0])
    assert prefix_text.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix_text
    assert [c[3] for c in calls] == [0, 1, 2] and len(calls[0][0]) == 4


def test_user_turn_prefix_llama3(llama3):
    prefix, end = data.user_turn_prefix(llama3)
    assert prefix == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert end == llama3.convert_tokens_to_ids("<|eot_id|>")


# ---------------------------------------------------------------------------------------------------------------
# draft vocabulary

def test_counts_only_masked_positions():
    samples = [{"input_ids": [5, 6, 7, 7, 9], "loss_mask": [0, 1, 1, 1, 0]},
               {"input_ids": [9, 9, 6], "loss_mask": [0, 0, 1]}]
    counts = vocab.count_token_frequencies(samples, 12, progress=False)
    assert counts.dtype == torch.int64 and counts.shape == (12,)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="outside"):
        vocab.count_token_frequencies([{"input_ids": [12], "loss_mask": [1]}], 12, progress=False)


def test_draft_vocab_offsets_injective_and_padding(tmp_path):
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 17, 8, 11, 2]] = torch.tensor([50, 40, 30, 30, 1])
    d2t, t2d = vocab.build_draft_vocab(counts, 4)  # top-4 by frequency (tie 8/11 both kept), 2 dropped
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (20,)
    used = torch.arange(4) + d2t
    assert used.tolist() == [3, 8, 11, 17] and d2t.tolist() == [3, 7, 9, 14]
    assert torch.nonzero(t2d).flatten().tolist() == used.tolist()
    d2t, t2d = vocab.build_draft_vocab(counts, 8)  # 5 distinct ids -> padded with the smallest unused ids
    used = (torch.arange(8) + d2t).tolist()
    assert used == sorted(set(used)) == [0, 1, 2, 3, 4, 8, 11, 17] and int(t2d.sum()) == 8
    identity, _ = vocab.build_draft_vocab(torch.ones(6, dtype=torch.long), 6)
    assert identity.tolist() == [0] * 6
    path = tmp_path / "counts.json"
    vocab.save_token_counts(path, counts, {"tokenizer": "test"})
    loaded, meta = vocab.load_token_counts(path)
    assert torch.equal(loaded, counts) and meta == {"tokenizer": "test"}


def test_draft_vocab_from_built_dataset(smol):
    convs = [conv(("user", "hello " * 5), ("assistant", "yes yes yes no")) for _ in range(2)]
    ds, _ = build_dataset(convs, smol, progress=False)
    d2t, t2d, counts = vocab.draft_vocab_from_dataset(ds, len(smol), 8, progress=False)
    user_only = smol(" hello", add_special_tokens=False)["input_ids"]
    assert all(counts[i] == 0 for i in user_only)  # user tokens never counted
    assert counts[smol.convert_tokens_to_ids("<|im_end|>")] == 2
    assert int(counts.sum()) == sum(sum(m) for m in ds["loss_mask"])
    assert bool(t2d[smol.convert_tokens_to_ids("<|im_end|>")]) and d2t.shape == (8,)
