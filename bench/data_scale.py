"""How the data path scales: a 200M-token corpus prepared as a run prepares it, against the
tokenizer alone on the same cores, and what the data costs each of 2 training ranks.

    .venv/bin/python bench/data_scale.py                       # 200M tokens (0.72 GB of text): ~10 min on 2 cores
    .venv/bin/python bench/data_scale.py --tokens 3e6 --json   # a few million tokens, about a minute (the test)
    .venv/bin/python bench/data_scale.py --workdir /big/disk   # the corpus is kept there and reused

1. The corpus (written once into --workdir, reused while its parameters match): English-like
   synthetic text, seeded. A lexicon of 30,000 pseudo-words built from syllables (the shorter
   ones the more frequent), drawn with Zipf-Mandelbrot frequencies (p_k ~ 1 / (k + 2.7)^1.05,
   as word counts of natural text go); sentences of 5 to ~40 words (capital first, commas, a
   full stop), paragraphs of 1-9 sentences, documents of ~320 words (1.7 kB), 64 MiB jsonl shards of
   {"text": ...}. Its size is set from the bytes per token of a tokenizer trained on a 16 MiB
   sample of the same generator, with 4% to spare, so the store holds at least --tokens tokens.
2. Preparation, in a fresh process with an empty datasets cache, exactly as `dsf train`'s rank 0
   does it: load_texts (jsonl -> Arrow cache) -> train_tokenizer (byte-level BPE, vocab --vocab,
   on at most 256 MiB) -> token_stores (datasets.map, 2 processes here, -> uint16 files).
   Measured: tokens in the store, wall time per phase, tokens/s, the preparing process's peak
   RSS (VmHWM) and its tokenizing children's (RUSAGE_CHILDREN ru_maxrss: the largest child; a
   forked child's RSS counts the copy-on-write pages it shares with its parent). A sampler thread
   also keeps the peak PSS of the process and its children together (/proc/PID/smaps_rollup:
   physical memory, a shared page counted once) and of its anonymous part (what is not file
   pages of the Arrow cache and the store, which the kernel drops at will).
3. The limit: the same fast tokenizer alone, in a fresh process, on the same texts (read from the
   same Arrow cache in batches of 1,000): the Rust encoder's batch encoding (encode_batch_fast)
   with TOKENIZERS_PARALLELISM=true, its threads on all cores, ids counted and dropped. Ratio:
   preparation / tokenizer alone. For reference, transformers' `tokenizer(texts)` (the call the
   store makes in each process) in the same process, over the first 32 MiB of text.
4. Each training rank's memory due to the data: `dsf train` (dsframework.train.engine.train, run by
   this file's worker) on 2 CPU ranks (deepspeed's launcher), tiny-llama, --steps steps of
   16 x seq_len, model.tokenizer = the tokenizer the preparation saved (so rank 0 reuses the
   cached store: the run measures training ranks, not preparation). Once on the big corpus, once
   on a tiny one (the same generator, 2 MiB, its store built beforehand with the same tokenizer):
   same model, same settings. Per rank VmHWM at the end of each, and the difference; for the big
   run, what of it is pages of the files under the datasets cache (/proc/self/smaps): the Arrow
   cache's, mapped by load_texts (unmapped with the rows when prepare returns); the store's, at
   the end.
5. A read probe: one process reading the big store as rank 0 of 2 reads it (BlockSampler order,
   TokenStore.micro_batch), --probe-rows rows, far more steps than the launches run: how a
   rank's memory grows with the rows it has read (store pages left mapped, the sampler's order).

Goals (issue 12): preparation's peak RSS under 2 GiB; a rank's growth under 100 MB whatever the
corpus size. Figures are also written to WORKDIR/figures.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_YAML = REPO / "launch" / "examples" / "tiny.yaml"
GiB, MiB = 2**30, 2**20
WORLD = 2
SHARD_BYTES = 64 * MiB
TINY_BYTES = 2 * MiB
CALIBRATION_BYTES = 16 * MiB
MARGIN = 1.04  # text written beyond the calibrated estimate: the store must hold at least --tokens
LEXICON, ZIPF_S, ZIPF_Q = 30_000, 1.05, 2.7
CORPUS_VERSION = 1  # bump when the generator changes: a corpus on disk is rebuilt


# --- the corpus ---------------------------------------------------------------------------------

def lexicon(seed: int) -> list[str]:
    """LEXICON distinct pseudo-words, most frequent first (shorter words ranked first, as in text)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "qu"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "y", "ie"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x"]
    words: set[str] = set()
    while len(words) < LEXICON:
        syllables = int(rng.choice([1, 2, 3, 4], p=[0.35, 0.35, 0.2, 0.1]))
        words.add("".join(onsets[rng.integers(len(onsets))] + nuclei[rng.integers(len(nuclei))]
                          + codas[rng.integers(len(codas))] for _ in range(syllables)))
    ordered = sorted(words)
    rng.shuffle(ordered)
    return sorted(ordered, key=lambda w: len(w) + rng.random() * 6)  # short words mostly, not only, first


def documents(n_words: int, rng, words: list[str]) -> list[str]:
    """Documents of about n_words words in total: sentences, paragraphs, documents (see the docstring)."""
    import numpy as np

    n = len(words)
    ranks = np.arange(n)
    p = 1.0 / (ranks + ZIPF_Q) ** ZIPF_S
    p /= p.sum()
    forms = words + [w + "," for w in words] + [w + "." for w in words]
    forms += [f.capitalize() for f in forms]  # 6 forms: (plain, comma, full stop) x (lower, capital)
    idx = rng.choice(n, size=n_words, p=p)
    sentence_len = 5 + rng.geometric(1 / 10, size=n_words // 5 + 1)
    ends = np.cumsum(sentence_len) - 1
    ends = ends[ends < n_words - 1]
    ends = np.append(ends, n_words - 1)
    punct = (rng.random(n_words) < 0.06).astype(np.int64)  # a comma
    punct[ends] = 2  # a full stop
    cap = np.zeros(n_words, dtype=np.int64)
    cap[0] = 1
    cap[ends[:-1] + 1] = 1
    tokens = [forms[i] for i in (idx + n * punct + 3 * n * cap).tolist()]
    # paragraphs of 1-9 sentences, documents of 1-8 paragraphs (~450 words)
    docs, paragraph, doc = [], [], []
    start = 0
    sentences_left = int(rng.integers(1, 10))
    paragraphs_left = int(rng.integers(1, 9))
    for end in ends.tolist():
        paragraph.append(" ".join(tokens[start:end + 1]))
        start = end + 1
        sentences_left -= 1
        if sentences_left == 0:
            doc.append(" ".join(paragraph))
            paragraph, sentences_left = [], int(rng.integers(1, 10))
            paragraphs_left -= 1
            if paragraphs_left == 0:
                docs.append("\n\n".join(doc) + "\n")
                doc, paragraphs_left = [], int(rng.integers(1, 9))
    if paragraph:
        doc.append(" ".join(paragraph))
    if doc:
        docs.append("\n\n".join(doc) + "\n")
    return docs


def write_corpus(directory: Path, total_bytes: int, *, seed: int) -> dict:
    """jsonl shards of ~SHARD_BYTES of text until total_bytes; their count, bytes and documents."""
    import numpy as np

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    words = lexicon(seed)
    rng = np.random.default_rng(seed + 1)
    bytes_per_word = 6.2  # a first guess, corrected as shards are written
    written = docs = shard = 0
    while written < total_bytes:
        want = min(SHARD_BYTES, total_bytes - written)
        batch = documents(max(int(want / bytes_per_word), 50), rng, words)
        size = 0
        with open(directory / f"part-{shard:05d}.jsonl", "w") as f:
            for text in batch:
                f.write(json.dumps({"text": text}) + "\n")
                size += len(text)
        words_in = sum(t.count(" ") + t.count("\n\n") + 1 for t in batch)
        bytes_per_word = size / max(words_in, 1)
        written, docs, shard = written + size, docs + len(batch), shard + 1
    info = {"bytes": written, "documents": docs, "shards": shard}
    return info


def calibrate(vocab: int, *, seed: int) -> float:
    """Text bytes per token of a byte-level BPE trained (train_tokenizer) on a sample of the generator."""
    import datasets
    import numpy as np

    from dsframework.config import DataSpec
    from dsframework.data import train_tokenizer

    rng = np.random.default_rng(seed + 7)
    texts = documents(int(CALIBRATION_BYTES / 6.2), rng, lexicon(seed))
    tokenizer = train_tokenizer(datasets.Dataset.from_dict({"text": texts}),
                                DataSpec(dataset="calibration.jsonl", tokenizer_vocab_size=vocab))
    tokens = sum(len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])  # + EOS
    return sum(len(t) for t in texts) / tokens


def corpus(workdir: Path, name: str, target_bytes: int | None, *, tokens: int | None, vocab: int, seed: int) -> dict:
    """The corpus WORKDIR/name, reused when WORKDIR/name.json matches; else written (sized by calibration)."""
    directory = workdir / name
    want = {"version": CORPUS_VERSION, "seed": seed, "tokens": tokens, "vocab": vocab, "bytes_target": target_bytes}
    done = workdir / f"{name}.json"  # beside the shards: a directory of data files holds data only
    if done.is_file():
        info = json.loads(done.read_text())
        if {k: info.get(k) for k in want} == want:
            return info | {"reused": True}
    start = time.perf_counter()
    bytes_per_token = None
    if target_bytes is None:
        bytes_per_token = calibrate(vocab, seed=seed)
        target_bytes = int(tokens * bytes_per_token * MARGIN)
    info = want | write_corpus(directory, target_bytes, seed=seed) | {
        "bytes_per_token_calibrated": bytes_per_token, "write_s": time.perf_counter() - start,
        "path": str(directory)}
    done.write_text(json.dumps(info, indent=1))
    return info | {"reused": False}


# --- memory ------------------------------------------------------------------------------------

def status(pid: int | str = "self", *, rollup: bool = False) -> dict[str, int]:
    """/proc/PID/status memory lines (VmHWM, VmRSS, RssAnon, RssFile, ...), or with rollup those of
    /proc/PID/smaps_rollup (Pss, Pss_Anon, Pss_File: pages shared by n processes count 1/n each), bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/{'smaps_rollup' if rollup else 'status'}").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def mapped_rss(under: Path) -> dict[str, int]:
    """Resident bytes of this process's file mappings under `under` (a datasets cache), split into
    the token store's files and the rest (datasets' Arrow files), from /proc/self/smaps."""
    out = {"store": 0, "arrow": 0}
    path = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and len(fields[1]) == 4:  # a mapping's header line
            path = fields[5] if len(fields) > 5 and fields[5].startswith(str(under)) else None
        elif path and fields[0] == "Rss:":
            out["store" if "dsframework-stores" in path else "arrow"] += int(fields[1]) * 1024
    return out


class MemorySampler:
    """A thread that samples memory while the preparation runs: every 0.1 s this process's own
    RssAnon and RssFile (/proc/self/status, cheap); less often the proportional set size (PSS) of
    the process and its descendants together: their physical memory, forked copy-on-write pages
    counted once, all of it and its anonymous part (what is not file pages the kernel may drop).
    Reading smaps_rollup walks the page tables (~50 ms for a 1 GiB process on a busy core), so
    that sample waits 40 times as long as it took: at most ~2.5% of a core."""

    def __init__(self):
        self.peaks = {"pss": 0, "pss_anon": 0, "children_pss": 0, "processes": 1, "own_anon": 0, "own_file": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        next_rollup = 0.0
        while not self._stop.wait(0.1):
            own = status()
            sample = {"own_anon": own.get("RssAnon", 0), "own_file": own.get("RssFile", 0)}
            began = time.perf_counter()
            if began >= next_rollup:
                rollups = [status(pid, rollup=True) for pid in [me, *descendants(me)]]
                sample.update(pss=sum(r.get("Pss", 0) for r in rollups),
                              pss_anon=sum(r.get("Pss_Anon", 0) for r in rollups),
                              children_pss=sum(r.get("Pss", 0) for r in rollups[1:]), processes=len(rollups))
                next_rollup = began + 40 * (time.perf_counter() - began)
            self.peaks = {k: max(v, sample.get(k, 0)) for k, v in self.peaks.items()}

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


# --- the processes this bench starts --------------------------------------------------------------

def run_overrides(corpus_dir: Path, tokenizer_dir: Path, output_dir: Path, args: argparse.Namespace) -> list[str]:
    """The run config (tiny.yaml + these) of the training launches; its `data` is what preparation uses."""
    return ["model.name=tiny-llama", f"model.tokenizer={tokenizer_dir}", f"data.dataset={corpus_dir}",
            "data.format=text", f"data.seq_len={args.seq_len}", f"data.tokenizer_vocab_size={args.vocab}",
            f"train.steps={args.steps}", "train.global_batch=16", "train.micro_batch=8", "train.grad_accum=1",
            "train.lr=1e-3", "train.warmup_steps=2", "train.precision=fp32", "parallel.zero_stage=2",
            "logging.every=1", "logging.eval_every=0", "logging.progress=false", "checkpoint.every=0",
            "checkpoint.save_final=false", f"output_dir={output_dir}"]


def prepare(record: Path, overrides: list[str], *, tokenizer: Path | None, save_tokenizer: Path | None,
            tiny: Path | None) -> None:
    """(fresh process) load_texts -> train_tokenizer (or the given one) -> token_stores, as dsf train's
    rank 0 does; then, measured no more, the tiny corpus's store with the same tokenizer."""
    sampler = MemorySampler()
    start = time.perf_counter()
    from dsframework.config import load_run_config
    from dsframework.data import load_texts, load_tokenizer, store_cache_dir, token_stores, train_tokenizer

    run = load_run_config(TINY_YAML, overrides)
    spec = run.data
    marks, hwm = {"imports": time.perf_counter()}, {"imports": status()["VmHWM"]}
    rows = load_texts(spec)
    marks["load_texts"], hwm["load_texts"] = time.perf_counter(), status()["VmHWM"]
    if tokenizer is None:
        trained = train_tokenizer(rows, spec)
        trained.save_pretrained(str(save_tokenizer))
        tokenizer = save_tokenizer
    tok = load_tokenizer(tokenizer)  # as the run loads it (model.tokenizer): the same store key
    marks["train_tokenizer"], hwm["train_tokenizer"] = time.perf_counter(), status()["VmHWM"]
    train, held_out = token_stores(rows, tok, spec, cache_dir=store_cache_dir())
    marks["token_stores"], hwm["token_stores"] = time.perf_counter(), status()["VmHWM"]
    phases, last = {}, start
    for name, at in marks.items():
        phases[name], last = at - last, at
    result = {"phases_s": phases, "wall_s": last - start, "documents": len(rows), "vocab": len(tok),
              "train": train.report, "eval": held_out.report, "store": str(train.directory),
              "tokens": train.report["tokens"] + held_out.report["tokens"],
              "vm_hwm": status()["VmHWM"], "vm_hwm_after": hwm,  # (ru_maxrss of SELF would include the forked parent's before exec)
              "children_ru_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
              "store_bytes": sum(f.stat().st_size for f in train.directory.iterdir())}
    result.update(sampler.stop())
    record.write_text(json.dumps(result, indent=1))
    if tiny is not None:
        spec = spec.model_copy(update={"dataset": str(tiny)})
        small, _ = token_stores(load_texts(spec), tok, spec, cache_dir=store_cache_dir())
        record.with_name("prepare-tiny.json").write_text(json.dumps({"train": small.report}))


def tokenize_alone(record: Path, overrides: list[str], tokenizer: Path) -> None:
    """(fresh process, TOKENIZERS_PARALLELISM=true) the fast tokenizer alone over the same texts: the
    Rust encoder's batch encoding (encode_batch_fast, its threads on every core) over all of them;
    then transformers' tokenizer(texts), the call the store makes, over the first 32 MiB."""
    from dsframework.config import load_run_config
    from dsframework.data import load_texts, load_tokenizer

    spec = load_run_config(TINY_YAML, overrides).data
    rows = load_texts(spec)  # from the Arrow cache the preparation left
    tok = load_tokenizer(tokenizer)
    backend = tok.backend_tokenizer
    tokens = 0
    start = time.perf_counter()
    for batch in rows.iter(batch_size=1000):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(batch["text"], add_special_tokens=False))
    seconds = time.perf_counter() - start
    call_tokens = text_bytes = 0
    start = time.perf_counter()
    for batch in rows.iter(batch_size=1000):
        call_tokens += sum(len(x) for x in tok(batch["text"], add_special_tokens=False)["input_ids"])
        text_bytes += sum(len(t) for t in batch["text"])
        if text_bytes >= 32 * MiB:
            break
    record.write_text(json.dumps({"tokens": tokens, "seconds": seconds, "call_tokens": call_tokens,
                                  "call_seconds": time.perf_counter() - start, "vm_hwm": status()["VmHWM"]}))


def read_probe(record: Path, store: Path, rows: int) -> None:
    """(fresh process) A rank's reads alone, many more than the launches make: up to `rows` rows
    through TokenStore.micro_batch in BlockSampler order (rank 0 of 2, micro-batch 8); this
    process's growth (VmHWM, store pages still mapped, anonymous) after 160, 2,000, ... rows."""
    import torch

    from dsframework.data import BlockSampler, TokenStore

    torch.set_num_threads(1)
    train = TokenStore(store, "train")
    sampler = BlockSampler(len(train), micro_batch=8, grad_accum=1, dp_size=WORLD, dp_rank=0, seed=1234)
    train.micro_batch([0])  # torch's first call maps its own pages
    before, mapped_before = status(), mapped_rss(store.parent.parent)
    marks = [m for m in (160, 2_000, 8_000, 32_000, 128_000) if m < rows] + [rows]
    start, read, consumed, points = time.perf_counter(), 0, 0, []
    while marks:
        for indices in sampler.micro_batches(consumed):
            train.micro_batch(indices)
            read += len(indices)
        consumed += sampler.global_batch
        if read >= marks[0]:
            marks.pop(0)
            now, mapped = status(), mapped_rss(store.parent.parent)
            points.append({"rows": read, "vm_hwm_growth": now["VmHWM"] - before["VmHWM"],
                           "anon_growth": now["RssAnon"] - before["RssAnon"],
                           "store_mapped_growth": mapped["store"] - mapped_before["store"]})
    record.write_text(json.dumps({"rows": read, "seconds": time.perf_counter() - start, "store_rows": len(train),
                                  "points": points}))


def worker(out: Path, overrides: list[str]) -> None:
    """(one per rank) dsf train's engine.train; writes out/rank<r>.json with VmHWM after prepare and at the end."""
    from dsframework.train import engine, setup
    from dsframework.config import load_run_config
    from dsframework.train.world import shutdown_distributed

    run = load_run_config(TINY_YAML, overrides)
    cache = Path(os.environ["HF_DATASETS_CACHE"]).resolve()
    marks: dict = {"start": status()["VmHWM"]}
    prepare_run = engine.prepare

    load_texts, held = setup.load_texts, []

    def marked_load_texts(*args, **kwargs):
        rows = load_texts(*args, **kwargs)
        marks["mapped_loaded"] = mapped_rss(cache)  # the Arrow cache's pages mapped, until prepare drops the rows
        return rows

    def marked_prepare(*args, **kwargs):
        session = prepare_run(*args, **kwargs)
        marks.update(rank=session.rank, prepared=status()["VmHWM"], train_rows=len(session.train_blocks))
        held.append(session.train_blocks)  # train() drops the session when it returns: keep its store mapped
        return session

    engine.prepare, setup.load_texts = marked_prepare, marked_load_texts  # the bench patches, dsf does not
    start = time.perf_counter()
    last = engine.train(run, overwrite=True)
    end = status()
    marks.update(end=end["VmHWM"], rss_end=end["VmRSS"], anon_end=end.get("RssAnon", 0), mapped_end=mapped_rss(cache),
                 train_s=time.perf_counter() - start, loss=last.get("loss"))
    (out / f"rank{marks['rank']}.json").write_text(json.dumps(marks))
    shutdown_distributed()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    env.pop("RANK", None)
    return env


def run_child(args: list[str], env: dict[str, str], log: Path, what: str) -> float:
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(args, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=7200).returncode
    if code != 0:
        lines = log.read_text(errors="replace").splitlines()
        errors = [line.strip() for line in lines if re.search(r"(Error|Exception|Killed|killed)\b", line)]
        last = (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1][:300]
        sys.exit(f"{what} failed (exit {code}): {last}\n  log: {log}")
    return time.perf_counter() - start


def launch(name: str, overrides: list[str], work: Path, env: dict[str, str]) -> list[dict]:
    """The worker on WORLD CPU ranks through deepspeed's per-node launcher; per-rank records."""
    from deepspeed.launcher.runner import encode_world_info

    from tests.distributed.launcher import free_port

    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    world_info = encode_world_info({"localhost": list(range(WORLD))})
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(Path(__file__).resolve()),
           "--worker", str(out), *sets]
    run_child(cmd, env, out / "log.txt", f"{name} launch")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# --- the table ----------------------------------------------------------------------------------

def markdown(f: dict) -> str:
    c, p, t = f["corpus"], f["prepare"], f["tokenizer_alone"]
    gib = lambda x: f"{x / GiB:.2f} GiB"  # noqa: E731
    mb = lambda x: f"{x / 1e6:+.1f} MB"  # noqa: E731
    ph = p["phases_s"]
    store_rate = p["tokens"] / ph["token_stores"]
    limit = t["tokens"] / t["seconds"]
    rows = [f"Corpus: {c['shards']} jsonl shards, {c['bytes'] / 1e9:.2f} GB of text, {c['documents']:,} documents "
            f"of synthetic English-like text (Zipf-Mandelbrot draws from {LEXICON:,} pseudo-words, seed {c['seed']}); "
            f"byte-level BPE vocab {p['vocab']:,}, seq_len {f['seq_len']}; {os.cpu_count()} CPU cores",
            "",
            "| preparation (fresh process, empty datasets cache) | figure |",
            "|---|---:|",
            f"| tokens in the store (train + eval, EOS included) | {p['tokens']:,} ({p['train']['tokens']:,} + "
            f"{p['eval']['tokens']:,}) |",
            f"| store on disk | {p['store_bytes'] / 1e6:,.0f} MB |",
            f"| wall: imports / load_texts / train_tokenizer / token_stores | {ph['imports']:.0f} / "
            f"{ph['load_texts']:.0f} / {ph['train_tokenizer']:.0f} / {ph['token_stores']:.0f} s |",
            f"| wall, all | {p['wall_s']:.0f} s |",
            f"| tokens/s, all of preparation | {p['tokens'] / p['wall_s']:,.0f} |",
            f"| tokens/s, token_stores alone | {store_rate:,.0f} |",
            f"| tokenizer alone: Rust batch encode (encode_batch_fast), TOKENIZERS_PARALLELISM=true, "
            f"{os.cpu_count()} cores | {limit:,.0f} tokens/s ({t['seconds']:.0f} s) |",
            f"| transformers' tokenizer(texts), the store's call, same process and threads (first 32 MiB) | "
            f"{t['call_tokens'] / t['call_seconds']:,.0f} tokens/s |",
            f"| preparation / tokenizer alone (token_stores alone / tokenizer alone) | "
            f"{p['tokens'] / p['wall_s'] / limit:.2f} ({store_rate / limit:.2f}) |",
            f"| peak RSS, preparing process (VmHWM) | {gib(p['vm_hwm'])} |",
            "| VmHWM after imports / load_texts / train_tokenizer / token_stores | "
            + " / ".join(f"{v / GiB:.2f}" for v in p["vm_hwm_after"].values()) + " GiB |",
            f"| peak RSS, tokenizing children (RUSAGE_CHILDREN ru_maxrss: the largest child) | "
            f"{gib(p['children_ru_maxrss'])} |",
            f"| peak PSS, process + children together ({p['processes']} processes at most): all / anonymous | "
            f"{gib(p['pss'])} / {gib(p['pss_anon'])} |",
            f"| the preparing process alone, peaks sampled every 0.1 s: anonymous (RssAnon) / file pages (RssFile) | "
            f"{gib(p['own_anon'])} / {gib(p['own_file'])} |",
            "",
            f"| rank | VmHWM, tiny corpus ({f['tiny_rows']:,} rows) | VmHWM, big corpus ({f['big_rows']:,} rows) "
            "| growth at the end | growth after prepare | big: Arrow cache pages mapped by load_texts | "
            "big: store pages mapped at the end | big - tiny: anonymous at the end |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for big, tiny in zip(f["ranks_big"], f["ranks_tiny"]):
        rows.append(f"| {big['rank']} | {tiny['end'] / 1e6:,.0f} MB | {big['end'] / 1e6:,.0f} MB | "
                    f"{mb(big['end'] - tiny['end'])} | {mb(big['prepared'] - tiny['prepared'])} | "
                    f"{big['mapped_loaded']['arrow'] / 1e6:.1f} MB | {big['mapped_end']['store'] / 1e6:.1f} MB | "
                    f"{mb(big['anon_end'] - tiny['anon_end'])} |")
    r = f["read_probe"]
    rows += ["", f"dsf train, tiny-llama, 2 CPU ranks, ZeRO-2, {f['steps']} steps of 16 x {f['seq_len']} tokens, "
             f"model.tokenizer = the prepared tokenizer (stores read from the cache); final loss "
             f"{f['ranks_big'][0]['loss']:.3f} (big) / {f['ranks_tiny'][0]['loss']:.3f} (tiny)",
             f"read probe: one process reading the big store ({r['store_rows']:,} rows) as rank 0 of 2 does "
             f"(8 rows a step, {r['rows'] / r['seconds']:,.0f} rows/s); its growth after"]
    rows += ["", "| rows read (steps) | VmHWM | store pages still mapped | anonymous |", "|---:|---:|---:|---:|"]
    rows += [f"| {p['rows']:,} ({p['rows'] // 8:,}) | {mb(p['vm_hwm_growth'])} | {mb(p['store_mapped_growth'])} | "
             f"{mb(p['anon_growth'])} |" for p in r["points"]]
    rows += ["",
             "wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in f["wall_s"].items())]
    return "\n".join(rows)


# --- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=200_000_000, help="tokens the store holds at least")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dsf-data-scale"),
                        help="corpus (kept, reused), datasets cache, logs")
    parser.add_argument("--vocab", type=int, default=8192, help="data.tokenizer_vocab_size")
    parser.add_argument("--seq-len", type=int, default=256, help="data.seq_len")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each launch")
    parser.add_argument("--seed", type=int, default=0, help="of the corpus")
    parser.add_argument("--probe-rows", type=int, default=128_000, help="rows a rank reads in the read probe")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, not the table")
    # set by this file for the processes it starts
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenize-alone", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--save-tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--read-probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the launcher's
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.overrides)
        return
    if args.prepare:
        prepare(args.prepare, args.overrides, tokenizer=args.tokenizer, save_tokenizer=args.save_tokenizer,
                tiny=args.tiny)
        return
    if args.read_probe:
        read_probe(args.read_probe, args.store, args.probe_rows)
        return
    if args.tokenize_alone:
        tokenize_alone(args.tokenize_alone, args.overrides, args.tokenizer)
        return
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}
    tokens = int(args.tokens)
    start = time.perf_counter()
    big = corpus(work, f"corpus-{tokens}", None, tokens=tokens, vocab=args.vocab, seed=args.seed)
    tiny = corpus(work, "corpus-tiny", TINY_BYTES, tokens=None, vocab=args.vocab, seed=args.seed + 100)
    walls["corpus" + (" (reused)" if big["reused"] else "")] = time.perf_counter() - start
    say(f"corpus: {big['bytes'] / 1e9:.2f} GB in {big['shards']} shards under {work}"
        + (" (reused)" if big["reused"] else f", written in {big['write_s']:.0f} s"))

    cache = work / "hf-cache"  # a fresh datasets cache: the preparation is measured cold
    shutil.rmtree(cache, ignore_errors=True)
    tokenizer_dir = work / "tokenizer"
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    big_overrides = run_overrides(Path(big["path"]), tokenizer_dir, work / "run-big", args)
    tiny_overrides = run_overrides(Path(tiny["path"]), tokenizer_dir, work / "run-tiny", args)
    env = child_env(HF_DATASETS_CACHE=str(cache))
    prep_env = {k: v for k, v in env.items() if k != "TOKENIZERS_PARALLELISM"}  # as a plain dsf train has it
    me = [sys.executable, str(Path(__file__).resolve())]
    sets = lambda overrides: [a for o in overrides for a in ("--set", o)]  # noqa: E731

    walls["preparation (and the tiny store)"] = run_child(
        [*me, "--prepare", str(work / "prepare.json"), "--save-tokenizer", str(tokenizer_dir), "--tiny", tiny["path"],
         *sets(big_overrides)], prep_env, work / "prepare.log", "preparation")
    prepared = json.loads((work / "prepare.json").read_text())
    say(f"preparation: {prepared['tokens']:,} tokens in {prepared['wall_s']:.0f} s")
    walls["tokenizer alone"] = run_child([*me, "--tokenize-alone", str(work / "tokenize.json"), "--tokenizer",
                                          str(tokenizer_dir), *sets(big_overrides)],
                                         dict(env, TOKENIZERS_PARALLELISM="true"), work / "tokenize.log",
                                         "tokenizer alone")
    alone = json.loads((work / "tokenize.json").read_text())
    say(f"tokenizer alone: {alone['tokens'] / alone['seconds']:,.0f} tokens/s")
    train_env = dict(env, TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    ranks_tiny = sorted(launch("launch-tiny", tiny_overrides, work, train_env), key=lambda r: r["rank"])
    walls["tiny launch"] = time.perf_counter() - start
    start = time.perf_counter()
    ranks_big = sorted(launch("launch-big", big_overrides, work, train_env), key=lambda r: r["rank"])
    walls["big launch"] = time.perf_counter() - start
    walls["read probe"] = run_child([*me, "--read-probe", str(work / "read-probe.json"), "--store", prepared["store"],
                                     "--probe-rows", str(args.probe_rows)], train_env, work / "read-probe.log",
                                    "read probe")
    probe = json.loads((work / "read-probe.json").read_text())
    figures = {"tokens_asked": tokens, "corpus": big, "prepare": prepared, "tokenizer_alone": alone,
               "ranks_big": ranks_big, "ranks_tiny": ranks_tiny, "big_rows": ranks_big[0]["train_rows"],
               "tiny_rows": ranks_tiny[0]["train_rows"], "seq_len": args.seq_len, "steps": args.steps,
               "rank_growth": [b["end"] - t["end"] for b, t in zip(ranks_big, ranks_tiny)], "read_probe": probe,
               "wall_s": walls}
    (work / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1) if args.json else markdown(figures))


if __name__ == "__main__":
    main()
