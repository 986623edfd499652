"""Chat and prompt/completion examples: token ids and the trained mask, against hand-computed masks."""
from __future__ import annotations

import itertools
import re

import pytest

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from dsframework.config import DataSpec  # noqa: E402
from dsframework.data.examples import tokenize_examples, use_chat_template  # noqa: E402
from dsframework.errors import UserError  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TWO_TURNS = [{"role": "system", "content": "Be kind."},
             {"role": "user", "content": "hi there"},
             {"role": "assistant", "content": "hello there, how are you?"},
             {"role": "user", "content": "the cat?"},
             {"role": "assistant", "content": "the cat sat on the mat"}]


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


@pytest.fixture(scope="module")
def _trained_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello there, how are you?", "the cat sat on the mat", "Be kind."] * 5, trainer=trainer)
    return tok.to_str()


@pytest.fixture
def tokenizer(_trained_bpe):
    """A fresh byte-level BPE tokenizer with <|im_start|>/<|im_end|> specials and no chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe), pad_token="<pad>",
                                   eos_token="<eos>")


def _chat(**kw) -> DataSpec:
    return DataSpec(dataset="chats.jsonl", format="chat", **{"chat_template": CHATML, **kw})


def _pc(**kw) -> DataSpec:
    return DataSpec(dataset="pairs.jsonl", format="prompt_completion", **kw)


def _rows(*conversations, field="messages"):
    return datasets.Dataset.from_list([{field: c} for c in conversations])


def _trained_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, m in zip(example["input_ids"], example["trained"]) if m])


def _runs(mask) -> int:
    return sum(1 for bit, _ in itertools.groupby(mask) if bit)


# --- chat ---------------------------------------------------------------------------------------

def test_chat_trains_exactly_the_assistant_turns_and_their_end_markers(tokenizer):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    (example,) = tokenize_examples(_rows(TWO_TURNS), tokenizer, spec)
    full = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    assert example["input_ids"] == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert len(example["trained"]) == len(example["input_ids"])
    assert _trained_text(tokenizer, example) == "hello there, how are you?<|im_end|>\nthe cat sat on the mat<|im_end|>\n"
    assert _runs(example["trained"]) == 2  # one contiguous run per assistant turn, headers excluded
    # by hand: the render cut where a header ends and a turn ends (pre-token boundaries of this tokenizer)
    parts = [("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", 0),
             ("hello there, how are you?<|im_end|>\n", 1),
             ("<|im_start|>user\nthe cat?<|im_end|>\n<|im_start|>assistant\n", 0),
             ("the cat sat on the mat<|im_end|>\n", 1)]
    assert "".join(text for text, _ in parts) == full
    pieces = [(tokenizer(text, add_special_tokens=False)["input_ids"], bit) for text, bit in parts]
    assert example["input_ids"] == [t for ids, _ in pieces for t in ids]
    assert example["trained"] == [bit for ids, bit in pieces for _ in ids]


def test_chat_train_on_prompt_trains_all_but_the_first_token(tokenizer):
    spec = _chat(train_on_prompt=True)
    use_chat_template(tokenizer, spec)
    (example,) = tokenize_examples(_rows(TWO_TURNS), tokenizer, spec)
    assert example["trained"] == [0] + [1] * (len(example["input_ids"]) - 1)


def test_chat_first_token_is_never_trained_even_when_it_opens_an_assistant_turn(tokenizer):
    bare = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content + '<|im_end|>' }}{% else %}"
            "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}{% endif %}{% endfor %}")
    spec = _chat(chat_template=bare)  # no header before an assistant turn, no generation prompt
    use_chat_template(tokenizer, spec)
    (example,) = tokenize_examples(_rows([{"role": "assistant", "content": "hello there"}]), tokenizer, spec)
    assert tokenizer.decode(example["input_ids"]) == "hello there<|im_end|>"
    assert example["trained"] == [0] + [1] * (len(example["input_ids"]) - 1)


def test_chat_opening_assistant_turn_excludes_its_header(tokenizer):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    (example,) = tokenize_examples(_rows(TWO_TURNS[2:]), tokenizer, spec)
    assert _trained_text(tokenizer, example) == "hello there, how are you?<|im_end|>\nthe cat sat on the mat<|im_end|>\n"
    refuses_empty = "{% if not messages %}{{ raise_exception('no turns') }}{% endif %}" + CHATML
    refusing = _chat(chat_template=refuses_empty)
    use_chat_template(tokenizer, refusing)
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(_rows(TWO_TURNS, TWO_TURNS[2:]), tokenizer, refusing)
    assert _one_line(excinfo) == ("row 1: the chat template fails on no turns (before the opening assistant turn) "
                                  "(TemplateError: no turns); fix the conversation or data.chat_template")


def test_chat_template_from_a_jinja_file(tokenizer, tmp_path):
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML, encoding="utf-8")
    spec = _chat(chat_template=str(path))
    use_chat_template(tokenizer, spec)
    assert tokenizer.chat_template == CHATML
    (example,) = tokenize_examples(_rows(TWO_TURNS), tokenizer, spec)
    assert _trained_text(tokenizer, example) == "hello there, how are you?<|im_end|>\nthe cat sat on the mat<|im_end|>\n"


def test_chat_without_an_assistant_turn_is_skipped_and_counted(tokenizer, capsys):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    user_only = [{"role": "user", "content": "hi"}]
    examples = tokenize_examples(_rows(user_only, TWO_TURNS, user_only), tokenizer, spec)
    assert len(examples) == 1
    assert "skipped 2 of 3 conversations with no assistant turn" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"^data.dataset='chats.jsonl': has no conversation with an assistant "
                                        r"turn; provide examples to train on$"):
        tokenize_examples(_rows(user_only), tokenizer, spec)


def test_chat_num_proc_2_matches_1(tokenizer):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    user_only = [{"role": "user", "content": "hi"}]
    convs = [TWO_TURNS[: 3 + (i % 3)] if i % 4 else user_only for i in range(24)]
    one = tokenize_examples(_rows(*convs), tokenizer, spec, num_proc=1)
    two = tokenize_examples(_rows(*convs), tokenizer, spec, num_proc=2)
    assert one.to_dict() == two.to_dict() and len(one) == 18


def test_extra_turn_keys_filled_with_none_by_datasets_are_dropped(tokenizer):
    spec = _chat(chat_template=CHATML.replace("m['role'] + '\\n'", "m['role'] + (' ' + m.name if m.name is "
                                              "defined else '') + '\\n'"))
    use_chat_template(tokenizer, spec)
    named = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "hello"}]
    rows = _rows(named, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert rows[1]["messages"][0]["name"] is None  # datasets unified the turns' keys
    first, second = tokenize_examples(rows, tokenizer, spec)
    assert tokenizer.decode(first["input_ids"]).startswith("<|im_start|>user ann\n")
    assert tokenizer.decode(second["input_ids"]).startswith("<|im_start|>user\n")


# --- prompt / completion ------------------------------------------------------------------------

@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_prompt_completion_masks(tokenizer, train_on_prompt):
    rows = datasets.Dataset.from_dict({"prompt": ["the cat", ""], "completion": [" sat on the mat", "hello"]})
    examples = tokenize_examples(rows, tokenizer, _pc(train_on_prompt=train_on_prompt))
    eos = tokenizer.eos_token_id
    for example, prompt, completion in zip(examples, rows["prompt"], rows["completion"]):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        assert example["input_ids"] == p + c + [eos]
        want = [1] * (len(p) + len(c) + 1) if train_on_prompt else [0] * len(p) + [1] * (len(c) + 1)
        assert example["trained"] == [0] + want[1:]
    if not train_on_prompt:
        assert _trained_text(tokenizer, examples[0]) == " sat on the mat<eos>"
        assert _trained_text(tokenizer, examples[1]) == tokenizer.decode(examples[1]["input_ids"][1:])


def test_prompt_completion_other_columns_and_num_proc_2(tokenizer):
    rows = datasets.Dataset.from_dict({"q": [f"the cat {i}" for i in range(10)], "a": [" sat"] * 10, "id": range(10)})
    spec = _pc(prompt_field="q", completion_field="a")
    one = tokenize_examples(rows, tokenizer, spec)
    assert one.column_names == ["input_ids", "trained"]
    assert one.to_dict() == tokenize_examples(rows, tokenizer, spec, num_proc=2).to_dict()


# --- bad input: one line each -------------------------------------------------------------------

def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("rows, message", [
    (["hello"], r"^row 0 messages: is 'hello', not a list of \{role, content\} dicts; give each row's messages as"),
    ([["hi", "there"]], r"^row 0 messages: is \['hi', 'there'\], not a list of \{role, content\} dicts;"),
    ([TWO_TURNS, [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "x"}]],
     r"^row 1 messages\[1\].role='asistant': is not a chat role \(system, user, assistant, tool\); "
     r"did you mean 'assistant'\?$"),
    ([TWO_TURNS, [{"role": "user"}, {"role": "assistant", "content": "x"}]],
     r"^row 1 messages\[0\].content: is None, not a string;"),
    ([TWO_TURNS, [{"content": "hi"}, {"role": "assistant", "content": "x"}]],
     r"^row 1 messages\[0\].role: is None, not a string;"),
])
def test_bad_chat_rows_name_the_row(tokenizer, rows, message):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(_rows(*rows), tokenizer, spec)
    assert re.search(message, _one_line(excinfo)), _one_line(excinfo)


def test_bad_row_in_a_worker_process_is_the_same_one_line(tokenizer):
    spec = _chat()
    use_chat_template(tokenizer, spec)
    bad = [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "x"}]
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(_rows(*[TWO_TURNS] * 5, bad), tokenizer, spec, num_proc=2)
    assert _one_line(excinfo) == ("row 5 messages[1].role='asistant': is not a chat role (system, user, assistant, "
                                  "tool); did you mean 'assistant'?")


def test_missing_columns_name_the_column_and_the_columns_present(tokenizer):
    rows = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(rows, tokenizer, _pc())
    assert _one_line(excinfo) == ("data.completion_field='completion': is not a column of the dataset "
                                  "(columns: prompt, answer); set data.completion_field to the column that holds it")
    with pytest.raises(UserError, match=r"^data.prompt_field='promt': .* did you mean 'prompt'\?$"):
        tokenize_examples(rows, tokenizer, _pc(prompt_field="promt", completion_field="answer"))
    spec = _chat(messages_field="conversation")
    use_chat_template(tokenizer, spec)
    with pytest.raises(UserError, match=r"^data.messages_field='conversation': is not a column of the dataset "
                                        r"\(columns: messages\)"):
        tokenize_examples(_rows(TWO_TURNS), tokenizer, spec)


def test_prompt_completion_none_value_names_the_row(tokenizer):
    rows = datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", None]})
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(rows, tokenizer, _pc())
    assert _one_line(excinfo) == "row 1 completion: is None, not a string; give every row a text completion"


def test_tokenizer_without_a_chat_template(tokenizer):
    spec = _chat(chat_template=None)
    with pytest.raises(UserError) as excinfo:
        use_chat_template(tokenizer, spec)
    text = _one_line(excinfo)
    assert text.startswith("data.chat_template: is not set and the tokenizer has no chat template")
    assert "data.chat_template" in text.split(";", 1)[1] and "model.tokenizer" in text
    with pytest.raises(UserError, match="tokenizer has no chat template"):
        tokenize_examples(_rows(TWO_TURNS), tokenizer, spec)
    use_chat_template(tokenizer, _pc())  # no template needed: nothing to say


@pytest.mark.parametrize("template, message", [
    ("chatml.jinja", r"^data.chat_template='chatml.jinja': is neither a file nor Jinja text"),
    ("{% for m in messages %}{{ m.content }}", r"^data.chat_template='\{% for m in messages %\}\{\{ m.content \}\}':"
                                               r" does not render a user/assistant exchange \(TemplateSyntaxError"),
    ("{{ 'nothing' }}", r"does not write the messages' content"),
])
def test_bad_chat_template(tokenizer, template, message):
    with pytest.raises(UserError) as excinfo:
        use_chat_template(tokenizer, _chat(chat_template=template))
    assert re.search(message, _one_line(excinfo)), _one_line(excinfo)


def test_template_that_rewrites_earlier_turns_is_refused_not_mis_masked(tokenizer):
    # the last turn ends with <eos>: the render up to the first assistant turn is no prefix of the whole
    spec = _chat(chat_template=CHATML.replace("'<|im_end|>\\n'", "'<|im_end|>' + ('<eos>' if loop.last else '') + '\\n'"))
    use_chat_template(tokenizer, spec)
    with pytest.raises(UserError) as excinfo:
        tokenize_examples(_rows(TWO_TURNS, TWO_TURNS), tokenizer, spec)
    assert _one_line(excinfo).startswith("row 0 messages[2]: the chat template's render of the conversation up "
                                         "to this assistant turn")
    (example,) = tokenize_examples(_rows(TWO_TURNS), tokenizer, _chat(chat_template=spec.chat_template,
                                                                       train_on_prompt=True))
    assert sum(example["trained"]) == len(example["input_ids"]) - 1  # the advertised way out works
