"""`dsf generate`: sample from an exported model or a checkpoint with transformers' `generate`.

    dsf generate runs/quickstart/hf --prompt "17,18,19,"                  # greedy (temperature 0)
    dsf generate runs/quickstart/checkpoints --prompt "17,18," --temperature 0.8 --seed 1 --num-samples 3

    spec = SampleSpec(max_new_tokens=16, temperature=0.0)                 # checked when built
    with model_directory("runs/quickstart/checkpoints") as hf_dir:        # exported to a temp dir
        model, tokenizer = load(hf_dir)
        for sample in generate(model, tokenizer, "17,18,19,", spec):
            print(sample.text)                                            # the prompt, continued

DIR is either what `dsf export` writes (config.json, safetensors weights, tokenizer) or a checkpoint
(`<output_dir>/checkpoints`, latest tag, or one `global_stepN` folder in it); a checkpoint is exported
with `export_checkpoint` into a temporary directory, removed afterwards (it holds fp32 weights: the
model's size on the temp filesystem), and nothing is written into the user's directories.

A tokenizer with a `chat_template` gets the prompt as one user turn, rendered with
`add_generation_prompt=True`, and the sample is only the reply (the new tokens); otherwise the raw
prompt is continued and the sample is the prompt followed by the continuation. Special tokens (EOS,
padding) are left out of the text. Temperature 0 is greedy; above 0 it samples (`do_sample=True`,
`top_p`, no top-k) after `torch.manual_seed(seed)`, so the same command on the same machine gives
the same samples. The model runs at its saved dtype (fp32 for a dsf export), on the GPU if any.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

from dsframework.checkpoints.export import export_checkpoint, locate
from dsframework.data import load_tokenizer
from dsframework.errors import UserError
from dsframework.models.hf import WEIGHT_FILES  # what from_pretrained loads
from dsframework.types import HFModel


@dataclass(frozen=True)
class SampleSpec:
    """How to sample; every field is checked when the spec is built (UserError naming the flag)."""

    max_new_tokens: int = 32     # tokens generated after the prompt, at most (EOS stops earlier)
    temperature: float = 0.0     # 0: greedy; > 0: sample from softmax(logits / temperature)
    top_p: float = 1.0           # nucleus sampling: keep the smallest set of tokens with this mass
    seed: int = 0                # seeds the sampling, so a run is reproducible
    num_samples: int = 1         # independent samples of the one prompt (sampling only)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError("--max-new-tokens", self.max_new_tokens, "must be >= 1",
                            "pass how many tokens to generate, e.g. --max-new-tokens 32")
        if not self.temperature >= 0:  # also NaN
            raise UserError("--temperature", self.temperature, "must be >= 0",
                            "use 0 for greedy decoding or a positive value such as 0.8 to sample")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p", self.top_p, "must be in (0, 1]", "use 1 to keep every token, e.g. 0.9")
        if self.num_samples < 1:
            raise UserError("--num-samples", self.num_samples, "must be >= 1", "pass 1 or more")
        if self.num_samples > 1 and self.greedy:
            raise UserError("--num-samples", self.num_samples, "needs sampling (greedy gives one answer)",
                            "pass --temperature > 0, e.g. --temperature 0.8")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Sample:
    """One generated sample: `text` is what `dsf generate` prints; `new_ids` the tokens generated."""

    text: str
    new_ids: list[int]


def is_export(path: Path) -> bool:
    """A transformers model directory: config.json beside weights that from_pretrained loads."""
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


@contextlib.contextmanager
def model_directory(path: str | Path) -> Iterator[Path]:
    """The transformers directory of DIR: DIR itself when it is an export, else DIR's checkpoint
    exported into a temporary directory (removed on exit). UserError when it is neither."""
    path = Path(path)
    if not path.exists():
        raise UserError("DIR", str(path), "does not exist",
                        "pass the OUT_DIR of dsf export or <output_dir>/checkpoints of a dsf run")
    if is_export(path):
        yield path
        return
    if (path / "config.json").is_file():
        raise UserError("DIR", str(path), f"has a config.json but no weights ({', '.join(WEIGHT_FILES[:2])})",
                        "pass the OUT_DIR of dsf export, or export a checkpoint with dsf export first")
    looks_like_checkpoint = ((path / "latest").is_file() or (path / "hf_config").is_dir()
                             or any(path.glob("*model_states.pt")))
    if not looks_like_checkpoint:
        fix = (f"did you mean {path / 'checkpoints'}?" if (path / "checkpoints").is_dir() else
               "pass the OUT_DIR of dsf export or <output_dir>/checkpoints of a dsf run")
        raise UserError("DIR", str(path), "is neither an exported model (config.json and weights) nor a "
                        "checkpoint directory (a 'latest' file, or a global_step* folder)", fix)

    try:
        ckpt_dir, tag = locate(path)
    except UserError as err:  # export's own words, but generate takes a tag as its folder, not --tag
        fix = "pass a complete global_step* folder in it as DIR" if "--tag" in err.fix else err.fix
        raise UserError(err.field, err.value, err.rule, fix) from None
    with tempfile.TemporaryDirectory(prefix="dsf-generate-") as scratch:
        # stdout is the sample: deepspeed's logger (bound to the stdout it finds when first imported)
        # and zero_to_fp32's prints go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            exported = export_checkpoint(ckpt_dir, Path(scratch) / "hf", tag=tag)
        yield exported


def load(directory: str | Path, *, device: str | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a transformers directory, never the hub; `device`
    defaults to the GPU when there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(directory, field="DIR")
    # as an nn.Module: transformers wraps PreTrainedModel.to (functools.wraps), which pyright reads as unbound
    model = cast(HFModel, AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer


def render_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids the model sees: with a chat template, the prompt as one user turn followed by
    the assistant's opening (`add_generation_prompt=True`); else the prompt as the tokenizer encodes
    it (with the special tokens it adds itself, such as a BOS)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids  # the template writes its own BOS
    return tokenizer(prompt).input_ids


def generate(model: Any, tokenizer: Any, prompt: str, spec: SampleSpec) -> list[Sample]:
    """`spec.num_samples` samples of `prompt` (see the module docstring for what `text` holds)."""
    import torch

    chat = bool(getattr(tokenizer, "chat_template", None))
    ids = render_prompt(tokenizer, prompt)
    if not ids:
        raise UserError("--prompt", prompt, "encodes to no tokens", "pass a non-empty prompt")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    knobs: dict[str, Any] = (dict(do_sample=False, temperature=None, top_p=None, top_k=None) if spec.greedy else
                             dict(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=None,
                                  num_return_sequences=spec.num_samples))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(spec.seed)  # generate draws from the default generator (CPU and, seeded too, CUDA)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=spec.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, **knobs)
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    samples = []
    for row in out.tolist():
        new = row[len(ids):]
        if tokenizer.eos_token_id in new:  # what follows EOS is padding (another sample ran longer)
            new = new[:new.index(tokenizer.eos_token_id) + 1]
        # prompt and reply decoded together (a tokenizer may join them differently), then the prompt dropped
        full = tokenizer.decode(ids + new, skip_special_tokens=True)
        reply = full[len(shown):] if full.startswith(shown) else tokenizer.decode(new, skip_special_tokens=True)
        samples.append(Sample(text=reply if chat else prompt + reply, new_ids=new))
    return samples
