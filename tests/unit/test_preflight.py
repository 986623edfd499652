"""`dsf train`'s pre-flight names in one line what used to be a traceback after the data was loaded
(issue 34, item 6): a model the host's RAM cannot hold, data.seq_len past the model's positions,
an output_dir that cannot be written, an empty `latest` beside a complete checkpoint.

    python -m pytest tests/unit/test_preflight.py -q

Each case runs `dsf train` in this process as `dsf` does (test_bad_input.run_dsf_in_process: stdout
and stderr at the file descriptors, a fresh `dsf`'s environment, forming the process group raises
FormsAProcessGroup), as rank 0 of the world it names, and asserts the one line on stderr, exit code
2, and that nothing was written or deleted. A run that passes pre-flight gets as far as the
process group, where it stops (no rank is started).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsframework.errors import UserError
from dsframework.train.setup import tf32_in_use, use_tf32
from tests.unit.test_bad_input import FormsAProcessGroup, TINY_YAML, run_dsf_in_process, sets, snapshot

LLAMA_7B = ("model.name=llama-7b", "parallel.zero_stage=0")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


def world_of(size: int, *, rank: int = 0) -> dict[str, str]:
    """Rank `rank` of a world of `size` ranks on this node, as the deepspeed launcher starts it."""
    from tests.distributed.launcher import free_port

    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def train(tmp_path: Path, hf_home: Path, capfd, monkeypatch, *settings: str, out: Path | None = None,
          flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = ["train", str(TINY_YAML), *sets(f"output_dir={out or tmp_path / 'out'}", *settings), *flags]
    return run_dsf_in_process(args, cwd=tmp_path, home=hf_home, capfd=capfd, monkeypatch=monkeypatch, env=env)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The `dsf: error: ...` line of a refused run (exit 2, no traceback, nothing else on stderr)."""
    report = f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, report
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsf: error: "), report
    return lines[0]


def gets_to_the_process_group(tmp_path: Path, hf_home: Path, capfd, monkeypatch, *settings: str,
                              flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    """stderr of a run that passes pre-flight (it stops where the process group would form)."""
    with pytest.raises(FormsAProcessGroup):
        train(tmp_path, hf_home, capfd, monkeypatch, *settings, flags=flags, env=env)
    return capfd.readouterr().err


# --- memory ----------------------------------------------------------------------------------------

@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 200 * 2**30,
                    reason="llama-7b at ZeRO-0 fits two CPU ranks of this host")
def test_a_model_the_hosts_ram_cannot_hold_is_refused_as_dsf_launch_refuses_it(tmp_path, hf_home, capfd,
                                                                               monkeypatch):
    """llama-7b at ZeRO-0 on 2 CPU ranks (was `DefaultCPUAllocator: can't allocate memory` after ~50 s):
    each rank's pre-flight refuses it with the figures `dsf launch --dry-run` gives, from one function."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the ranks are GPUs here: only their host part counts against the RAM")
    line = one_line(train(tmp_path, hf_home, capfd, monkeypatch, *LLAMA_7B, env=world_of(2)))
    assert line.startswith("dsf: error: memory per rank: predicted "), line
    assert "GiB per rank >" in line and "RAM / 2 ranks" in line and "ZeRO-0" in line, line
    assert "dsf plan --model llama-7b" in line and "--force to train anyway" in line, line
    assert not (tmp_path / "out").exists()
    launch = one_line(run_dsf_in_process(["launch", str(TINY_YAML), "--num-gpus", "2", "--dry-run", *sets(*LLAMA_7B)],
                                         cwd=tmp_path, home=hf_home, capfd=capfd, monkeypatch=monkeypatch))
    figures = line.split(": ", 3)[3].split(" for ")[0]  # 'predicted X GiB per rank > Y GiB available (source)'
    assert launch.split(": ", 3)[3].split(" for ")[0] == figures, (launch, line)
    # --force: rank 0 says so once and goes on (here to the process group, where this case stops)
    err = gets_to_the_process_group(tmp_path, hf_home, capfd, monkeypatch, *LLAMA_7B, flags=("--force",),
                                    env=world_of(2))
    assert err.count("dsf: warning: memory per rank: predicted ") == 1 and "training anyway (--force)" in err, err


def test_a_gpu_rank_counts_only_what_lives_on_the_host():
    """The shared rule's two budgets (planner/fit.py): on a GPU rank (device=False) the device's own
    memory is not the host's: llama-70b at ZeRO-3 on 8 H100s over-fills the GPUs (what `dsf launch`
    refuses) but not a host of 512 GiB, unless its optimizer states are offloaded there."""
    from dataclasses import replace

    from dsframework.config import build_run_config
    from dsframework.layout import ParallelDims
    from dsframework.models.build import resolve_model
    from dsframework.planner.cluster import load_cluster
    from dsframework.planner.run_fit import fit_run

    def refusal(*settings: str, device: bool):
        run = build_run_config({}, ["model.name=llama-70b", "parallel.zero_stage=3", "train.global_batch=8",
                                          "train.micro_batch=1", "data.seq_len=1024", *settings])
        cluster = replace(load_cluster("h100-80gb", nodes=1, gpus_per_node=8), cpu_memory_per_node=512 * 2**30)
        dims = ParallelDims.of(run.parallel, world=8)
        fit = fit_run(run, resolve_model(run.model).config, dims, cluster)
        return fit.refusal(run, source="h100-80gb", preset="h100-80gb", nodes=1, ranks_per_node=8, device=device)

    assert refusal(device=False) is None
    assert str(refusal(device=True)).startswith("memory per rank: predicted ")
    offloaded = refusal("parallel.offload_optimizer=cpu", device=False)
    assert offloaded is not None and str(offloaded).startswith("host memory per node: predicted "), offloaded
    assert "hold its offloaded states" in str(offloaded)


# --- data.seq_len against the model's positions ----------------------------------------------------

def test_seq_len_past_learned_positions_is_refused(tmp_path, hf_home, capfd, monkeypatch):
    """GPT-2's 512 learned positions (was `IndexError: index out of range in self` in the first step)."""
    line = one_line(train(tmp_path, hf_home, capfd, monkeypatch, "model.name=tiny-gpt2", "data.seq_len=513"))
    assert line == ("dsf: error: data.seq_len=513: exceeds the 512 positions 'gpt2' has learned (n_positions=512: "
                    "position 512 has no embedding); set data.seq_len <= 512"), line
    assert not (tmp_path / "out").exists()


def test_seq_len_past_unscaled_rotary_positions_is_rank_0s_warning(tmp_path, hf_home, capfd, monkeypatch):
    """tiny-llama's 512 rotary positions, unscaled: trains (was without a word), rank 0 warns once."""
    err = gets_to_the_process_group(tmp_path, hf_home, capfd, monkeypatch, "data.seq_len=640", env=world_of(2))
    warning = [line for line in err.splitlines() if "data.seq_len" in line]
    assert warning == ["dsf: warning: data.seq_len=640 exceeds max_position_embeddings=512 of 'llama', whose rotary "
                       "positions are not scaled: positions past 512 are extrapolated, unseen in pre-training; set "
                       "data.seq_len <= 512, or scale them (rope_parameters in the model's config)"], err
    rank1 = gets_to_the_process_group(tmp_path, hf_home, capfd, monkeypatch, "data.seq_len=640",
                                      env=world_of(2, rank=1))
    assert "data.seq_len" not in rank1, rank1


# --- output_dir ------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_output_dir_that_is_a_file_is_refused(tmp_path, hf_home, capfd, monkeypatch, where):
    """(was NotADirectoryError after the data was loaded)"""
    (tmp_path / "out").write_text("not a directory\n")
    out = tmp_path / "out" if where == "a-file" else tmp_path / "out" / "run"
    line = one_line(train(tmp_path, hf_home, capfd, monkeypatch, out=out))
    rule = "is a file" if where == "a-file" else f"lies under {tmp_path / 'out'}, which is a file"
    assert line == (f"dsf: error: output_dir='{out}': {rule}, not a directory; set output_dir to a directory "
                    "(--set output_dir=NEW_DIR)"), line
    assert snapshot(tmp_path / "out") == {".": b"not a directory\n"}


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A read-only tmpfs holding one file (root writes through chmod, not through a read-only mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        (ro / "notes.txt").write_text("keep me\n")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("under", [False, True])
def test_an_output_dir_on_a_read_only_filesystem_is_refused(tmp_path, hf_home, capfd, monkeypatch, read_only_dir,
                                                            under):
    """(was `OSError: [Errno 30] Read-only file system` after the data was loaded)"""
    out = read_only_dir / "run" if under else read_only_dir
    line = one_line(train(tmp_path, hf_home, capfd, monkeypatch, out=out))
    assert line == (f"dsf: error: output_dir='{out}': cannot be written (Read-only file system: {read_only_dir}); "
                    "make it writable, or set output_dir to a writable directory"), line
    assert snapshot(read_only_dir) == {"notes.txt": b"keep me\n"}


def test_a_writable_output_dir_is_left_as_it_was(tmp_path, hf_home, capfd, monkeypatch):
    """The probe is removed: a run refused later (here at the process group) leaves no file behind but
    the lock it took at the end of pre-flight (checkpoints/outputs.py: its first write), released."""
    from dsframework.checkpoints.outputs import LOCK, holder

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me\n")
    gets_to_the_process_group(tmp_path, hf_home, capfd, monkeypatch)
    assert snapshot(tmp_path / "out") == {"notes.txt": b"keep me\n"}  # (snapshot leaves the lock file out)
    assert (tmp_path / "out" / LOCK).is_file() and holder(tmp_path / "out") is None, "the lock, released"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- an empty `latest` -----------------------------------------------------------------------------

def checkpoint(ckpt_dir: Path, step: int, *, complete: bool) -> None:
    """global_step<step> with a model file and the manifest a save writes (one file missing when not complete)."""
    from dsframework.checkpoints.manifest import MANIFEST, Manifest

    tag = ckpt_dir / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights" * step)
    files = {"mp_rank_00_model_states.pt": 7 * step, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 100}
    if complete:
        (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 100)
    Manifest(step, None, files).write(tag / MANIFEST)


@pytest.mark.parametrize("latest", ["", None])
def test_resume_with_an_empty_latest_names_the_newest_complete_checkpoint(tmp_path, hf_home, capfd, monkeypatch,
                                                                          latest):
    """(was 'run without --resume', which leads toward --overwrite): global_step4 lacks a file, so the
    newest that verifies is global_step2, and the fix names it."""
    ckpt_dir = tmp_path / "out" / "checkpoints"
    for step, complete in ((1, True), (2, True), (4, False)):
        checkpoint(ckpt_dir, step, complete=complete)
    if latest is not None:
        (ckpt_dir / "latest").write_text(latest)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 4}\n')
    before = snapshot(tmp_path / "out")
    line = one_line(train(tmp_path, hf_home, capfd, monkeypatch, flags=("--resume",)))
    state = "is empty" if latest is not None else "is missing"
    assert line == (f"dsf: error: checkpoint='{ckpt_dir / 'latest'}': {state}, but global_step2 in {ckpt_dir} is "
                    f"complete (its manifest verifies); resume from it: echo global_step2 > {ckpt_dir / 'latest'}; "
                    "then run with --resume again"), line
    assert "--overwrite" not in line and snapshot(tmp_path / "out") == before


def test_tf32_auto_is_off_without_cuda_and_true_is_refused():
    """train.tf32 on this CPU: auto decides off and leaves torch's fp32 alone; true is the user's
    error, named with the field and the fix (the CLI's one line: test_bad_input's train-tf32-without-cuda)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: auto may turn TF32 on")
    before = torch.get_float32_matmul_precision()
    assert use_tf32("auto") is False and torch.get_float32_matmul_precision() == before
    assert use_tf32(False) is False and not tf32_in_use()
    with pytest.raises(UserError, match=r"^train.tf32=True: needs a CUDA device; .*set train.tf32=auto"):
        use_tf32(True)
