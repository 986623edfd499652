"""Chat and prompt/completion examples -> token ids and a loss mask, one example per row.

    use_chat_template(tokenizer, run.data)       # data.chat_template (text or .jinja path), else the tokenizer's
    examples = tokenize_examples(rows, tokenizer, run.data, num_proc=4)
    examples[0]   # {"input_ids": [5, 17, ...], "trained": [0, 0, ..., 1, 1, 0]}

`trained[t] == 1` means token t is a label the loss is computed on (predicted from the tokens before
it). What is trained:

- chat (`messages_field`: a list of {role, content} turns, rendered by `tokenizer.apply_chat_template`):
  each assistant turn's tokens, its content and whatever the template closes the turn with (an
  end-of-turn token, a newline), never the header before it (`<|im_start|>assistant\\n`). The turn of
  assistant message i spans [len(render(messages[:i], add_generation_prompt=True)),
  len(render(messages[:i+1]))) in the tokens of the full render; both prefix renders must be
  token prefixes of the full render, else the row is refused (a template that rewrites earlier turns
  cannot be masked this way, and a silent mis-mask would train on the wrong tokens). A conversation
  with no assistant turn is skipped (one line on stdout says how many).
- prompt_completion: tokens(prompt) + tokens(completion) + [eos]; the completion and the EOS.
- `train_on_prompt: true`: every token.

The first token of every example is never trained: examples are packed side by side, and nothing
of its own example precedes it.

Text is tokenized with `add_special_tokens=False`, like the text path: a tokenizer's BOS/EOS
post-processor would otherwise put specials inside an example (a chat template writes its own BOS;
prompt_completion appends the EOS itself). Prompt and completion are tokenized apart, so no token
straddles the two (the completion's first token is the same whatever the prompt).

What is mapped is a module-level function with its arguments in `fn_kwargs`, so datasets'
`map(num_proc=N)` can pickle it into worker processes.
"""
from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

from dsframework.config import DataSpec
from dsframework.errors import UserError, did_you_mean

ROLES = ("system", "user", "assistant", "tool")
_SAMPLE = [{"role": "user", "content": "ping-7b1"}, {"role": "assistant", "content": "pong-3c9"}]
_TEMPLATE_FIX = ("set data.chat_template to Jinja text or a .jinja file, or point model.tokenizer to a "
                 "tokenizer whose tokenizer_config.json (or chat_template.jinja) has a chat_template")


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 60, 60, 3, 3


def _short(value: Any) -> str:
    """A repr of a user's value short enough for a one-line error."""
    return _REPR.repr(value)


# --- the chat template --------------------------------------------------------------------------

def _template_text(value: str) -> str:
    """The Jinja text of data.chat_template: the value itself, or the file it names."""
    path = Path(value).expanduser()
    try:
        is_file = "\n" not in value and path.is_file()
    except OSError:  # a long template is no file name
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError("data.chat_template", value, f"could not be read ({type(err).__name__})",
                            "give a readable UTF-8 .jinja file") from None
    if "{{" in value or "{%" in value:
        return value
    raise UserError("data.chat_template", value, "is neither a file nor Jinja text (no {{ }} or {% %})",
                    "give the template text, or the path of an existing .jinja file")


def use_chat_template(tokenizer: Any, spec: DataSpec) -> None:
    """Give the tokenizer spec.chat_template (text or .jinja path) when set; for format chat, a tokenizer
    with no chat_template is a one-line UserError that says how to give one."""
    if spec.chat_template is not None:
        text = _template_text(spec.chat_template)
        shown = spec.chat_template if len(spec.chat_template) <= 60 else spec.chat_template[:57] + "..."
        try:
            rendered = tokenizer.apply_chat_template(_SAMPLE, chat_template=text, tokenize=False)
        except Exception as err:  # noqa: BLE001 - jinja raises syntax, undefined and template errors
            raise UserError("data.chat_template", shown, f"does not render a user/assistant exchange "
                            f"({type(err).__name__}: {err})", "fix the template") from None
        if not all(m["content"] in rendered for m in _SAMPLE):
            raise UserError("data.chat_template", shown, "does not write the messages' content",
                            "render each message['content'] in the template")
        tokenizer.chat_template = text
    if spec.format == "chat":
        _require_template(tokenizer)


def _require_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("data.chat_template", None, "is not set and the tokenizer has no chat template "
                        "(format chat renders each conversation with one)", _TEMPLATE_FIX)


# --- the mapped functions (module level, so that num_proc can pickle them) -------------------------

def _checked_messages(messages: Any, row: int, field: str) -> list[dict[str, Any]]:
    """The row's turns as plain dicts, or a one-line UserError naming the row and the turn.

    datasets gives every turn the union of the keys of all turns (absent ones None); those Nones are
    dropped, so the template sees the keys the user wrote (`message.name is defined`)."""
    fix = f'give each row\'s {field} as [{{"role": "user", "content": "..."}}, ...]'
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UserError(f"row {row} {field}", None, f"is {_short(messages)}, not a list of {{role, content}} "
                        "dicts", fix)
    turns = []
    for j, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise UserError(f"row {row} {field}[{j}].role", None, f"is {_short(role)}, not a string", fix)
        if role not in ROLES:
            raise UserError(f"row {row} {field}[{j}].role", role, f"is not a chat role ({', '.join(ROLES)})",
                            did_you_mean(role, ROLES))
        if not isinstance(content, str):
            raise UserError(f"row {row} {field}[{j}].content", None, f"is {_short(content)}, not a string",
                            fix)
        turns.append({k: v for k, v in message.items() if v is not None})
    return turns


def _render(tokenizer: Any, messages: list[dict[str, Any]], row: int, *, generation_prompt: bool) -> str:
    """The template's text for these turns. Passed as a batch of one conversation, since
    apply_chat_template refuses an empty one, and the generation prompt before an assistant turn
    that opens the conversation is the render of no turns."""
    try:
        return tokenizer.apply_chat_template([messages], tokenize=False,
                                             add_generation_prompt=generation_prompt)[0]
    except Exception as err:  # noqa: BLE001 - jinja raises syntax, undefined and template errors
        what = f"its first {len(messages)} turns" if messages else "no turns (before the opening assistant turn)"
        raise UserError(f"row {row}", None, f"the chat template fails on {what} ({type(err).__name__}: {err})",
                        "fix the conversation or data.chat_template") from None


def _tokenize_chat(batch: dict[str, list], indices: list[int], *, tokenizer: Any, field: str,
                   train_on_prompt: bool) -> dict[str, list]:
    ids_out, trained_out = [], []
    for messages, row in zip(batch[field], indices):
        messages = _checked_messages(messages, row, field)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            continue  # skipped; tokenize_examples counts them
        texts = [_render(tokenizer, messages, row, generation_prompt=False)]
        if not train_on_prompt:
            for i in turns:
                texts.append(_render(tokenizer, messages[:i], row, generation_prompt=True))
                texts.append(_render(tokenizer, messages[: i + 1], row, generation_prompt=False))
        full, *bounds = tokenizer(texts, add_special_tokens=False)["input_ids"]
        trained = [int(train_on_prompt)] * len(full)
        for k, i in enumerate(turns if not train_on_prompt else []):
            head, turn = bounds[2 * k], bounds[2 * k + 1]
            if not (len(head) <= len(turn) and full[: len(turn)] == turn and turn[: len(head)] == head):
                raise UserError(f"row {row} {field}[{i}]", None, "the chat template's render of the "
                                "conversation up to this assistant turn (with the generation prompt, then "
                                "with the turn) is not a token prefix of the whole conversation's, so its "
                                "tokens cannot be masked", "use a template that renders earlier turns the same "
                                "whatever follows, or set data.train_on_prompt=true")
            trained[len(head): len(turn)] = [1] * (len(turn) - len(head))
        if trained:
            trained[0] = 0
        ids_out.append(full)
        trained_out.append(trained)
    return {"input_ids": ids_out, "trained": trained_out}


def _tokenize_prompt_completion(batch: dict[str, list], indices: list[int], *, tokenizer: Any,
                                prompt_field: str, completion_field: str, train_on_prompt: bool) -> dict[str, list]:
    for field in (prompt_field, completion_field):
        for value, row in zip(batch[field], indices):
            if not isinstance(value, str):
                raise UserError(f"row {row} {field}", None, f"is {_short(value)}, not a string",
                                f"give every row a text {field}")
    prompts = tokenizer(batch[prompt_field], add_special_tokens=False)["input_ids"]
    completions = tokenizer(batch[completion_field], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    ids_out, trained_out = [], []
    for prompt, completion in zip(prompts, completions):
        ids = prompt + completion + [eos]
        trained = [1] * len(ids) if train_on_prompt else [0] * len(prompt) + [1] * (len(completion) + 1)
        trained[0] = 0
        ids_out.append(ids)
        trained_out.append(trained)
    return {"input_ids": ids_out, "trained": trained_out}


# --- the entry point ----------------------------------------------------------------------------

def _require_columns(rows: Any, named: dict[str, str]) -> None:
    present = list(rows.column_names)
    for spec_field, column in named.items():
        if column not in present:
            hint = did_you_mean(column, present) if present else ""
            fix = hint if hint.startswith("did you mean") else f"set data.{spec_field} to the column that holds it"
            raise UserError(f"data.{spec_field}", column, f"is not a column of the dataset (columns: "
                            f"{', '.join(present) or 'none'})", fix)


def tokenize_examples(rows: Any, tokenizer: Any, spec: DataSpec, *, num_proc: int | None = None) -> Any:
    """A datasets.Dataset with columns `input_ids` (list of int) and `trained` (list of 0/1 of the same
    length: 1 = a label the loss is computed on), one row per example, via datasets' batched map (on
    disk for file-backed data, nothing held whole in memory). `rows` has the columns named by spec:
    messages_field for chat; prompt_field and completion_field for prompt_completion. For chat, call
    use_chat_template first (or give a tokenizer with a chat_template)."""
    import datasets

    if spec.format == "chat":
        _require_columns(rows, {"messages_field": spec.messages_field})
        _require_template(tokenizer)
        function, kwargs, what = _tokenize_chat, {"field": spec.messages_field}, "conversations"
    elif spec.format == "prompt_completion":
        _require_columns(rows, {"prompt_field": spec.prompt_field, "completion_field": spec.completion_field})
        if tokenizer.eos_token_id is None:
            raise UserError("model.tokenizer", None, "has no EOS token",
                            "use a tokenizer with an eos_token; each completion ends with it")
        function, what = _tokenize_prompt_completion, "prompt/completion examples"
        kwargs = {"prompt_field": spec.prompt_field, "completion_field": spec.completion_field}
    else:
        raise ValueError(f"tokenize_examples is for format chat or prompt_completion, not {spec.format!r}")
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "trained": datasets.List(datasets.Value("int8"))})
    examples = rows.map(function, batched=True, with_indices=True, num_proc=num_proc,
                        remove_columns=rows.column_names, features=features, desc=f"tokenizing {what}",
                        fn_kwargs={"tokenizer": tokenizer, "train_on_prompt": spec.train_on_prompt, **kwargs})
    skipped = len(rows) - len(examples)
    if skipped:
        print(f"dsf: skipped {skipped} of {len(rows)} conversations with no assistant turn", flush=True)
    if len(examples) == 0:
        rule = "has no conversation with an assistant turn" if spec.format == "chat" else "has no examples"
        raise UserError("data.dataset", spec.dataset, rule, "provide examples to train on")
    return examples
