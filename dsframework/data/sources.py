"""Where the rows come from: a built-in task, or the user's local data, as a datasets.Dataset.

    rows = load_texts(run.data)
    # format text:               column "text" (or "input_ids", when the data is already tokenized)
    # format chat:               column "messages" (a list of {role, content} turns per row)
    # format prompt_completion:  columns "prompt" and "completion"

User data is read by `datasets` into its Arrow cache on disk and memory-mapped from there, so
no process holds the corpus: a json/jsonl/csv/parquet/txt file, a directory of them (its top
level), a glob (`'src/**/*.py'`: with format text, any extension is read as text), or a
`save_to_disk` directory. A text file is one document by default (`data.text_unit`), newlines kept.
"""
from __future__ import annotations

import glob
import sysconfig
from pathlib import Path
from typing import Any, cast

from dsframework.config import DataSpec
from dsframework.data.tasks import BUILTIN_TASKS, generate_task
from dsframework.errors import UserError, did_you_mean

TABULAR = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_SUFFIXES = {".txt", ".text"}  # read as text in a directory; a glob with format text reads any suffix


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (
        path / "state.json").is_file()


def _builder_of(file: str, spec: DataSpec, *, any_text: bool) -> str | None:
    suffix = Path(file).suffix.lower()
    if suffix in TABULAR:
        return TABULAR[suffix]
    if suffix in TEXT_SUFFIXES or (any_text and spec.format == "text"):
        return "text"
    return None


STDLIB = "{stdlib}"  # in data.dataset: this interpreter's standard library (a corpus every machine has)


def dataset_path(spec: DataSpec) -> str:
    """data.dataset with `~` and `{stdlib}` expanded: `{stdlib}/**/*.py` is every module of the Python
    standard library of the machine the run is on (sysconfig), e.g. launch/examples/python-stdlib.yaml."""
    return str(Path(spec.dataset.replace(STDLIB, sysconfig.get_paths()["stdlib"])).expanduser())


def data_files(spec: DataSpec) -> tuple[str, list[str]]:
    """(datasets builder, sorted files) of a file, directory or glob; one builder for all files."""
    path = Path(dataset_path(spec))
    is_glob = any(ch in spec.dataset for ch in "*?[")
    if path.is_dir():
        candidates = [str(p) for p in path.iterdir()]  # top level only: a glob with ** reaches further
    else:
        candidates = glob.glob(str(path), recursive=True)
    # A glob or a single file names its files itself: with format text any suffix is text.
    if STDLIB in spec.dataset:  # the standard library only, not what was installed into it
        candidates = [f for f in candidates if not {"site-packages", "dist-packages"} & set(Path(f).parts)]
    builders = {f: _builder_of(f, spec, any_text=is_glob or path.is_file()) for f in sorted(candidates)}
    files = [f for f, builder in builders.items() if builder is not None and Path(f).is_file()]
    if not files:
        raise UserError("data.dataset", spec.dataset,
                        "is neither a built-in task nor a data file, directory, glob or saved dataset",
                        f"use one of {sorted(BUILTIN_TASKS)}, a .jsonl/.json/.csv/.parquet/.txt path, or a glob "
                        "such as 'src/**/*.py' with data.format=text")
    kinds = cast("set[str]", {builders[f] for f in files})  # files: those with a builder
    if len(kinds) > 1:
        raise UserError("data.dataset", spec.dataset, f"mixes formats {sorted(kinds)}",
                        "point to files of one format")
    return kinds.pop(), files


def _read_files(spec: DataSpec) -> Any:
    import datasets

    builder, files = data_files(spec)
    options = {}
    if builder == "text":  # datasets' default is a row per line, newlines dropped
        # A byte that is not UTF-8 becomes U+FFFD (a corpus of sources holds a few latin-1 files).
        options = {"sample_by": spec.text_unit, "keep_linebreaks": spec.text_unit != "line", "encoding_errors": "replace"}
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log would be a 2nd line
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **options)
    except Exception as err:  # noqa: BLE001 - datasets raises many types for a malformed file
        raise UserError("data.dataset", spec.dataset, f"could not be read: {type(err).__name__}",
                        "check that every file is valid for its extension") from None
    finally:
        datasets.logging.set_verbosity(level)


def _columns(loaded: Any, spec: DataSpec) -> dict[str, str]:
    """{column in the data: column the store reads} for the run's format."""
    if spec.format == "chat":
        wanted = {spec.messages_field: "messages"}
    elif spec.format == "prompt_completion":
        wanted = {spec.prompt_field: "prompt", spec.completion_field: "completion"}
    elif "input_ids" in loaded.column_names and spec.text_field not in loaded.column_names:
        return {"input_ids": "input_ids"}  # already tokenized
    else:
        wanted = {spec.text_field: "text"}
    field = {"chat": "data.messages_field", "text": "data.text_field"}
    for column, role in wanted.items():
        if column not in loaded.column_names:
            name = field.get(spec.format, f"data.{role}_field")
            raise UserError(name, column, f"is not a column of {spec.dataset} (format {spec.format}; columns: "
                            f"{', '.join(loaded.column_names)})", did_you_mean(column, loaded.column_names))
    return wanted


def load_texts(spec: DataSpec) -> Any:
    """A datasets.Dataset with the columns of the run's format (see the module docstring)."""
    import datasets

    if spec.dataset in BUILTIN_TASKS:
        if spec.format != "text":
            raise UserError("data.format", spec.format, f"does not apply to the built-in task {spec.dataset!r}",
                            "use data.format=text, or a chat / prompt-completion file")
        texts = generate_task(spec.dataset, num_examples=spec.num_examples, digits=spec.max_digits,
                              seed=spec.seed)
        return datasets.Dataset.from_dict({"text": texts})
    path = Path(dataset_path(spec))
    if path.is_dir() and _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    else:
        loaded = _read_files(spec)
    columns = _columns(loaded, spec)
    rows = loaded.select_columns(list(columns))
    renames = {old: new for old, new in columns.items() if old != new}
    if renames:
        rows = rows.rename_columns(renames)
    if "text" in columns.values():
        return rows.filter(_has_text, batched=True)
    if "input_ids" in columns.values():
        return rows.filter(_has_ids, batched=True)
    return rows


def _has_text(batch: dict[str, list]) -> list[bool]:
    return [bool(text) for text in batch["text"]]


def _has_ids(batch: dict[str, list]) -> list[bool]:
    return [bool(ids) for ids in batch["input_ids"]]
