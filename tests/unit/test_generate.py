"""`dsf generate`: an exported directory or a checkpoint in, the prompt continued out.

    python -m pytest tests/unit/test_generate.py -q

A tiny random Llama with a character tokenizer (dsframework's own, trained here) is saved as an
export once per module; one real 2-step `dsf train` (a world of one, ~10 s) gives the checkpoint that
must generate exactly what its export does. Bad input runs the real command line: one line, exit 2.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from dsframework.errors import UserError
from dsframework.commands.generate import SampleSpec, generate, load, model_directory, render_prompt
from tests.distributed.launcher import BIN, TINY_YAML, dsf, rank_env

PROMPT = "17,18,19,"
CHAT_TEMPLATE = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
                 "{% if add_generation_prompt %}<bot>{% endif %}")
TINY_RUN = ("train.steps=2", "train.warmup_steps=1", "train.global_batch=4", "train.micro_batch=2",
            "data.num_examples=200", "data.seq_len=16", "logging.eval_every=0", "logging.progress=false",
            "checkpoint.every=0")


def char_tokenizer() -> object:
    """One token per character of the counting task and the chat markers, plus dsf's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    vocab = {token: i for i, token in enumerate([*specials.values(), *sorted(set("0123456789,<user/>bot"))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def save_tiny_model(directory: Path, *, chat_template: str | None = None) -> Path:
    """A random 1-layer Llama and a character tokenizer, saved as `dsf export` writes them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    tokenizer.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dsf"), "generate", *args], capture_output=True, text=True, timeout=120,
                          env=rank_env())


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("export") / "hf")


@pytest.fixture(scope="module")
def tiny(export_dir, one_thread):
    return load(export_dir)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    """<output_dir>/checkpoints of a 2-step tiny-llama run (ZeRO-2, one process)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    dsf("train", str(TINY_YAML), *[a for kv in (*TINY_RUN, f"output_dir={out}") for a in ("--set", kv)])
    assert (out / "checkpoints" / "latest").is_file()
    return out / "checkpoints"


@pytest.mark.distributed
def test_export_dir_prints_prompt_and_continuation(export_dir, tiny):
    model, tokenizer = tiny
    (sample,) = generate(model, tokenizer, PROMPT, SampleSpec(max_new_tokens=8))
    new = sample.new_ids
    assert len(new) == 8 or (len(new) < 8 and new[-1] == tokenizer.eos_token_id), new
    assert sample.text == PROMPT + tokenizer.decode(new, skip_special_tokens=True)
    shown = [i for i in new if i not in tokenizer.all_special_ids]  # one character each
    assert len(sample.text) == len(PROMPT) + len(shown)

    proc = run_generate(str(export_dir), "--prompt", PROMPT, "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sample.text + "\n"
    assert proc.stderr == ""  # no progress bars or warnings


def test_chat_template_renders_one_user_turn_and_prints_the_reply(tmp_path, one_thread):
    chat_dir = save_tiny_model(tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    model, tokenizer = load(chat_dir)  # the template survives save_pretrained / from_pretrained
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = render_prompt(tokenizer, PROMPT)
    assert tokenizer.decode(ids) == f"<user>{PROMPT}</user><bot>"
    assert ids[-5:] == tokenizer("<bot>", add_special_tokens=False).input_ids

    seen = []
    real_generate = model.generate
    model.generate = lambda input_ids, **kw: seen.append(input_ids[0].tolist()) or real_generate(input_ids, **kw)
    (sample,) = generate(model, tokenizer, PROMPT, SampleSpec(max_new_tokens=6))
    assert seen == [ids]  # the model sees the rendered turn
    assert sample.text == tokenizer.decode(sample.new_ids, skip_special_tokens=True)  # only the reply

    raw_model, raw_tokenizer = load(save_tiny_model(tmp_path / "raw"))
    assert render_prompt(raw_tokenizer, PROMPT) == raw_tokenizer(PROMPT).input_ids  # no template: as is


def test_greedy_is_deterministic_and_sampling_is_seeded(tiny):
    model, tokenizer = tiny
    greedy = SampleSpec(max_new_tokens=10)
    assert generate(model, tokenizer, PROMPT, greedy) == generate(model, tokenizer, PROMPT, greedy)

    def sampled(seed: int) -> list:
        spec = SampleSpec(max_new_tokens=10, temperature=1.5, top_p=0.95, seed=seed, num_samples=3)
        return generate(model, tokenizer, PROMPT, spec)

    first = sampled(1)
    assert len(first) == 3 and all(s.text.startswith(PROMPT) for s in first)
    assert sampled(1) == first
    assert sampled(2) != first


@pytest.mark.distributed
def test_checkpoint_generates_what_its_export_does(ckpt_dir, tmp_path, one_thread):
    from dsframework.checkpoints.export import export_checkpoint

    before = sorted(p.relative_to(ckpt_dir.parent) for p in ckpt_dir.parent.rglob("*"))
    spec = SampleSpec(max_new_tokens=12, temperature=1.0, seed=3)  # sampling: every token's odds matter
    model, tokenizer = load(export_checkpoint(ckpt_dir, tmp_path / "hf"))
    want = generate(model, tokenizer, PROMPT, spec)
    ids = torch.tensor([render_prompt(tokenizer, PROMPT)])
    tag = (ckpt_dir / "latest").read_text().strip()
    for path in (ckpt_dir, ckpt_dir / tag):
        with model_directory(path) as hf_dir:
            assert not hf_dir.is_relative_to(ckpt_dir.parent)
            got_model, got_tokenizer = load(hf_dir)
        assert not hf_dir.exists()  # the temporary export is removed
        assert torch.equal(got_model(ids).logits, model(ids).logits)
        assert generate(got_model, got_tokenizer, PROMPT, spec) == want

    proc = run_generate(str(ckpt_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "1",
                        "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want[0].text + "\n"  # deepspeed's log lines, if any, went to stderr
    assert sorted(p.relative_to(ckpt_dir.parent) for p in ckpt_dir.parent.rglob("*")) == before


def test_empty_prompt_is_a_user_error(tiny):
    with pytest.raises(UserError, match="--prompt"):
        generate(*tiny, "", SampleSpec())


@pytest.mark.parametrize("flags, field", [
    (["--max-new-tokens", "-1"], "--max-new-tokens=-1"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["--temperature", "-0.5"], "--temperature=-0.5"),
    (["--top-p", "1.5"], "--top-p=1.5"),
    (["--num-samples", "2"], "--num-samples=2"),  # greedy has one answer
    (["--max-new-tokens", "many"], "--max-new-tokens"),  # click's own one line
])
@pytest.mark.distributed
def test_bad_flags_are_one_line_exit_2(export_dir, flags, field):
    proc = run_generate(str(export_dir), "--prompt", PROMPT, *flags)
    assert_one_line_error(proc, field)


@pytest.mark.parametrize("make, field, fix", [
    (lambda root: root / "missing", "DIR=", "dsf export"),
    (lambda root: root, "DIR=", "dsf export"),  # an empty directory
    (lambda root: (root / "config.json").write_text("{}") and root, "no weights", "dsf export"),
    (lambda root: (root / "checkpoints").mkdir() or root, "DIR=", "did you mean"),  # a run's output_dir
    (lambda root: (root / "latest").write_text("global_step9") and root, "CKPT_DIR=", "global_step"),
])
@pytest.mark.distributed
def test_bad_dirs_are_one_line_exit_2(tmp_path, make, field, fix):
    proc = run_generate(str(make(tmp_path)), "--prompt", PROMPT)
    assert_one_line_error(proc, field, fix)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["config.json"], ["checkpoints"], ["latest"])


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsf: error: "), proc.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stdout == ""
