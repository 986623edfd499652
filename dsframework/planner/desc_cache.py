"""`dsf plan` remembers each model it has described, so that planning it again (other nodes, batch,
pins, `--explain`) imports neither torch nor transformers: about 1 s instead of 4-6.

    cache = DescCache.for_spec(spec.model_dump(mode="json"))   # None: DSF_PLAN_CACHE=off
    desc = cache.load(load_counts=lambda: model_counts(config))  # a ModelDesc, or None
    ...                                                         # plan with it
    cache.save(desc)          # its fields, and every tensor-parallel size the search counted

Counting a model builds it on the meta device with transformers (planner/count.py: exact for every
architecture), and importing torch and transformers' modelling code is most of what a `dsf plan`
process pays. What the count gives is a few kB: the ModelDesc's fields and, per tp, one rank's
tensors per pipeline layer (TensorShares) or why tp cannot split it. A file holds them, keyed by
the model spec (preset or path, overrides), the text of the config.json a path names,
transformers' version and the size and modification time of every dsframework source file: a
changed counter, model file or transformers is a miss, never a stale count. A tp the file does not
hold is counted when asked (the config loaded then: torch after all) and the file grows by it.
DSF_PLAN_CACHE=DIR puts the files in DIR (default: $XDG_CACHE_HOME/dsframework/plan, else
~/.cache/dsframework/plan); DSF_PLAN_CACHE=off turns the cache off. A file that cannot be read or
written is ignored: the cache only ever saves time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsframework.planner.desc import Counts, ModelDesc, SharesByTp, TensorShares

ENV = "DSF_PLAN_CACHE"
PACKAGE = Path(__file__).resolve().parents[1]  # dsframework/
FORMAT = 1  # bump when the file's layout changes


def _tuples(value: Any) -> Any:
    """JSON's lists back into the tuples ModelDesc and TensorShares hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _shares_to_json(shares: TensorShares | str) -> Any:
    return shares if isinstance(shares, str) else [[list(sizes), kind] for sizes, kind in shares.items]


def _shares_from_json(tp: int, value: Any) -> TensorShares | str:
    return value if isinstance(value, str) else TensorShares(tp=tp, items=_tuples(value))


class CachedCounts(SharesByTp):
    """A ModelDesc's counts read back from its file (desc.Counts); a tp it lacks is counted on the
    model itself, then kept (`added`)."""

    def __init__(self, pipeline_problem: str | None, shares: dict[int, TensorShares | str],
                 load_counts: Callable[[], Counts]) -> None:
        self.pipeline_problem, self._shares, self._load_counts = pipeline_problem, shares, load_counts
        self.added = False

    def _count_or_why(self, tp: int) -> TensorShares | str:
        counts = self._load_counts()  # count.ModelCounts: torch, only for a tp never counted
        self.added = True
        problem = counts.tp_problem(tp)
        return counts.shares(tp) if problem is None else problem


class DescCache:
    """One model's file in the cache directory (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_spec(cls, spec: dict[str, Any]) -> "DescCache | None":
        """The file of the model `spec` (ModelSpec's JSON dump) names; None when the cache is off."""
        where = os.environ.get(ENV, "")
        if where.lower() == "off":
            return None
        try:
            root = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
                "dsframework" / "plan"
            return cls(root / f"{_key(spec)}.json")
        except (OSError, RuntimeError):  # no home directory, or a source file gone mid-scan: no cache
            return None

    def load(self, *, load_counts: Callable[[], Counts]) -> ModelDesc | None:
        """The ModelDesc kept for this key, its counts from the file (`load_counts`: the model's own
        count.ModelCounts, called only for a tp the file lacks); None when there is none."""
        try:
            data = json.loads(self.path.read_text())
            fields = {name: _tuples(value) for name, value in data["desc"].items()}
            shares = {int(tp): _shares_from_json(int(tp), value) for tp, value in data["shares"].items()}
            counts = CachedCounts(data["pipeline_problem"], shares, load_counts)
            return ModelDesc(**fields, counts=counts)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or unreadable: count again
            return None

    def save(self, desc: ModelDesc) -> None:
        """Keep `desc` and every tp its counts hold (nothing new: no write)."""
        counts = desc.counts
        if counts is None or (isinstance(counts, CachedCounts) and not counts.added):
            return
        fields = {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc) if f.name != "counts"}
        data = {"desc": fields, "pipeline_problem": counts.pipeline_problem,
                "shares": {str(tp): _shares_to_json(s) for tp, s in sorted(counts.computed().items())}}
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(data))
            partial.replace(self.path)  # whole or not at all: a second `dsf plan` may be reading it
        except OSError:  # a read-only or full disk: the plan is printed all the same, nothing left behind
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)


def _key(spec: dict[str, Any]) -> str:
    """What decides a model's counts: its spec, the config.json a path names, transformers' version and
    dsframework's source files (size and mtime: any edit re-counts)."""
    name = str(spec.get("name") or "")
    try:  # a preset's name is no path; a name too long for one is no file either
        config = Path(name) / "config.json" if Path(name).is_dir() else Path(name)
        config_text = config.read_text() if name and config.is_file() else None
    except (OSError, ValueError, UnicodeDecodeError):
        config_text = None
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    sources = sorted((str(p.relative_to(PACKAGE)), stat.st_size, stat.st_mtime_ns)
                     for p in PACKAGE.rglob("*.py") for stat in (p.stat(),))
    text = json.dumps([FORMAT, spec, config_text, transformers, sources], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
