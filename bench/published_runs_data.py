"""Published large-scale training runs as data: what each source measured, on what layout, counted how.

`RUNS` holds one `PublishedRun` per row of a published table, for `bench/published_runs.py` to set
beside what `dsf plan` predicts for the same model, GPU count and layout. Every number below was read
in the source named in the row; where a field is not printed in the table itself and was taken from
the run's config or script, `notes` says so, and a field no source gives is None.

Sources
-------
1. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
   (SC21, arXiv:2104.04473).
   - Table 1 (weak scaling, 1.7B to 1008B): the paper's text (section 5.1) and the same numbers in
     NVIDIA/Megatron-LM images/cases_april2021.png@50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a (README
     table up to July 2024; it has "model-parallel size" = tp x pp but no heads column).
   - Micro-batch, tp/pp split, heads, recompute, precision and the interleaved schedule per row:
     NVIDIA/Megatron-LM examples/sc21/run_table_1.sh and examples/sc21/CONFIG.sh
     @6985e58938d40ad91ac07b0fddcfad8132e1447e (the commit the scripts' README says reproduces the
     paper; today under examples/academic_paper_scripts/sc21/, same values).
   - Table 2 / Figure 10 (section 5.2, PTD-P against ZeRO-3 without model parallelism): the paper's
     Table 2, read from the paper text and from the image of it in
     cli99/llm-analysis figures/megatron-lm-2nd-table-2.png@d841e40aec8c84b9e76ba9cfbce67418adb172bd.
     Figure 10 only plots these rows. GPU counts are 384/768/1536 (175B) and 640 or 560/1120/2240
     (530B), not 640/1280/2560.
   Hardware: Selene, DGX A100 nodes, 8 x A100 80GB, NVLink/NVSwitch, 8 x 200 Gb/s HDR IB per node.
   The paper's peak is 312 TFLOP/s ("A100 with 16-bit precision"); the scripts train in fp16
   (--fp16 --loss-scale 8192).
2. torchtitan (pytorch/torchtitan), benchmarks/*.md:
   - benchmarks/llama3_h100_202412_torchtitan.md@820504e20d1149fbf0b98c567af24c4b0433b22d (first
     published as torchtitan/docs/performance.md@d4c86e3758a84cf23e2e879ab3c995cba9d5e410, same numbers; run at
     torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b, torch 1963fc8, torchao eab345c), Tables 1-6.
   - benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md@2887250bbd9103d0bc997ea2efb3a525b5e5dbc0
     (run at torchtitan 820504e).
   - benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md@cbccb387871a5e1f522c1e222c51ab88b03c0392
     (Trainy on WhiteFiber H200s, run at torchtitan e7c0cae).
   - the older torchtitan/docs/performance.md: Llama 3.1 405B on 128 H100 @3faaa1a0dee68ce028400e3dafd1735d152cb4f8
     (2024-08) and Llama 3 8B/70B on 64 A100 80GB @157a12c562288b3bccb077003a97f18a4ca657aa (2024-04).
   The H100s of the torchtitan files are Grand Teton H100 SXM with 96 GB HBM2e at a 500 W power limit
   (not the 80 GB, 700 W H100 SXM); they are given the "h100-80gb" preset here, so expect dsf's
   prediction to be faster than these rows. The sequence length is not printed in the 2024-12 and
   2025-06 files: 8192 is the train_configs default at the torchtitan commit each file names (and the
   2024-12 file's 33-39% MFU for the 8B only comes out at 8192). Model shapes: torchtitan
   torchtitan/models/llama/__init__.py@9dec370 and torchtitan/models/llama3/__init__.py@b5bcd76c
   (8B: dim 4096, 32 layers, 32 heads, 8 kv heads, ffn 14336; 70B: 8192, 80, 64, 8, 28672; 405B:
   16384, 126, 128, 8, 53248; ffn = multiple_of-rounded int(mult * int(8 dim / 3)); vocab 128256).
   "Local batch size" in torchtitan is per data-parallel rank (FSDP shard x replicate, not tp/pp/cp),
   so global_batch = local x dp below.

How FLOPs are counted (flop_formula)
------------------------------------
- "ptdp_eq3": the paper's eq. (3), F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration (B
  sequences of s tokens, l layers, hidden h, vocab V). Only the GEMMs of the transformer and the
  logit layer; it assumes full activation recomputation and counts its extra forward pass (so it is
  4 passes, i.e. 8 N per token, not the 6 N of MFU); causal attention is not halved. The paper's
  "percentage of theoretical peak" (published_mfu here) is TFLOP/s / 312 under this count, closer to
  a hardware-FLOPs utilisation than to PaLM's MFU. Parameters by eq. (2),
  P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), reproduce every params_b below. GPT: ffn = 4h,
  kv_heads = heads.
- "torchtitan_6N+attn": torchtitan's get_num_flop_per_token, 6 N + 12 l H q s per token (N = all
  parameters except the token embedding, H heads, q = head dim, s = seq_len; the output projection
  counted; recomputation not counted; causal attention not halved). MFU = that x tokens/s / peak,
  peak = 989e12 for any H100 SXM (the bf16 dense figure; the files note their H100s are slower, so
  MFU is understated) and 312e12 for A100.
- "torchtitan_6Nall+attn": the same with N = all parameters including the embedding (torchtitan code
  of 2024-04, used by the A100 rows; checked: it reproduces their 56.8/58.2/51.7% exactly).
- "none": the source reports no FLOP count (tokens/s only).

deepspeed_differs lists what the published system did that DeepSpeed / dsf cannot (as of this
module): interleaved 1F1B, Megatron's scatter/gather of pipeline activations, FP8 linears, async TP,
selective (per-op or every-other-layer) activation checkpointing (dsf: none or full), ring-attention
context parallelism (dsf's cp is DeepSpeed Ulysses), FSDP/ZeRO-3 under a pipeline (DeepSpeed's
pipeline engine takes ZeRO 0-1), cp together with pp. torch.compile is not listed: dsf compiles too.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published throughput table, with the layout it ran and how its FLOPs are counted."""

    name: str
    source: str  # paper table/figure, or repository path@commit
    gpu: str  # dsf cluster preset: "a100-80gb", "h100-80gb", "h200-141gb"
    gpus: int
    params_b: float  # billions, as the source prints it (or computed from the shape: see notes)
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int | None  # sequences per forward pass per pipeline / data rank; None: not published
    tp: int
    pp: int
    cp: int
    dp: int
    zero_stage_or_fsdp: str  # "none", "zero3", "fsdp"
    recompute: str  # "full", "selective", "none"
    precision: str  # "bf16", "fp16", "fp8" (fp8: FP8 GEMMs in the linears, bf16 elsewhere)
    published_tflops_per_gpu: float | None
    published_tokens_per_s_per_gpu: float | None
    published_mfu: float | None  # fraction of peak as the source reports it, under flop_formula
    flop_formula: str  # "ptdp_eq3", "torchtitan_6N+attn", "torchtitan_6Nall+attn", "none"
    deepspeed_differs: str  # what the published system did that DeepSpeed / dsf cannot; "" if nothing
    notes: str
    # Megatron's sequence parallelism with its tp (torchtitan's TP plans shard the norms over the
    # sequence; the PTD-P paper predates it): dsf's row runs parallel.sequence_parallel the same way
    sequence_parallel: bool = False


# --- sources ----------------------------------------------------------------------------------------

_MLM = "NVIDIA/Megatron-LM"
_SC21 = "6985e58938d40ad91ac07b0fddcfad8132e1447e"
_PTDP_T1 = ("arXiv:2104.04473 Table 1 (sec. 5.1); layout, micro-batch, schedule: "
            f"{_MLM} examples/sc21/run_table_1.sh + CONFIG.sh@{_SC21}")
_PTDP_T2 = ("arXiv:2104.04473 Table 2 / Figure 10 (sec. 5.2); image of Table 2: "
            "cli99/llm-analysis figures/megatron-lm-2nd-table-2.png@d841e40aec8c84b9e76ba9cfbce67418adb172bd")
_TITAN = "pytorch/torchtitan"
_TT_2412 = f"{_TITAN} benchmarks/llama3_h100_202412_torchtitan.md@820504e20d1149fbf0b98c567af24c4b0433b22d"
_TT_ATP = f"{_TITAN} benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md@2887250bbd9103d0bc997ea2efb3a525b5e5dbc0"
_TT_H200 = (f"{_TITAN} benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
            "@cbccb387871a5e1f522c1e222c51ab88b03c0392")
_TT_2408 = f"{_TITAN} docs/performance.md@3faaa1a0dee68ce028400e3dafd1735d152cb4f8"
_TT_2404 = f"{_TITAN} docs/performance.md@157a12c562288b3bccb077003a97f18a4ca657aa"

# --- what DeepSpeed / dsf cannot do ----------------------------------------------------------------

_SG = "Megatron scatter/gather of pipeline activations over the tp ranks (sec. 4.1, on by default)"
_SAC = "selective activation checkpointing (dsf: none or full)"
_FP8 = "FP8 linears (torchao Float8, FP8 FSDP all-gather)"
_ATP = "async TP"
_RING = "ring-attention context parallel (dsf cp is DeepSpeed Ulysses)"
_FSDP_PP = "FSDP (ZeRO-3) under pipeline parallel (DeepSpeed's pipeline engine takes ZeRO 0-1)"
_CP_PP = "cp together with pp (not composable in dsf)"


def _differs(*items: str) -> str:
    return "; ".join(item for item in items if item)


# --- shapes -----------------------------------------------------------------------------------------

_GPT_VOCAB, _GPT_SEQ = 51200, 2048
_LLAMA_VOCAB = 128256
# (params_b computed from the shape, untied embedding and output: 8.030, 70.554, 405.853 billion)
_LLAMA = {
    "8b": dict(params_b=8.03, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8),
    "70b": dict(params_b=70.55, hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8),
    "405b": dict(params_b=405.85, hidden=16384, ffn=53248, layers=126, heads=128, kv_heads=8),
}
_LLAMA_PARAMS_NOTE = "params_b computed from the shape (not printed in the source)"


# --- Megatron-LM PTD-P, Table 1 ---------------------------------------------------------------------

def _ptdp_t1(params_b: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
             batch: int, micro: int, tflops: float, pct: int, agg_pflops: float,
             layers_per_virtual_stage: int | None, ddp: str) -> PublishedRun:
    dp = gpus // (tp * pp)
    if layers_per_virtual_stage is not None:
        chunks = layers // pp // layers_per_virtual_stage
        schedule = f"interleaved 1F1B, {chunks} chunks of {layers_per_virtual_stage} layers per stage"
        differs = _differs(f"interleaved 1F1B (v={chunks})", _SG)
    elif pp > 1:
        schedule = "non-interleaved 1F1B (script sets no virtual stages)"
        differs = _SG
    else:
        schedule = "no pipeline"
        differs = ""
    return PublishedRun(
        name=f"ptdp-t1-{params_b:g}b", source=_PTDP_T1, gpu="a100-80gb", gpus=gpus, params_b=params_b,
        hidden=hidden, ffn=4 * hidden, layers=layers, heads=heads, kv_heads=heads, vocab=_GPT_VOCAB,
        seq_len=_GPT_SEQ, global_batch=batch, micro_batch=micro, tp=tp, pp=pp, cp=1, dp=dp,
        zero_stage_or_fsdp="none", recompute="full", precision="fp16", published_tflops_per_gpu=tflops,
        published_tokens_per_s_per_gpu=None, published_mfu=pct / 100, flop_formula="ptdp_eq3",
        deepspeed_differs=differs,
        notes=(f"aggregate {agg_pflops} PFLOP/s published; {schedule}; {batch // (dp * micro)} micro-batches "
               f"per step per pipeline; recompute: --activations-checkpoint-method uniform (1 layer per "
               f"checkpoint); Megatron DDP impl '{ddp}'; micro-batch, tp/pp split and schedule from "
               "run_table_1.sh (the table prints tp, pp, not the micro-batch). The paper's sec. 5.1 says "
               "'we use the interleaved pipeline schedule with the scatter/gather optimization enabled', "
               "but the script sets virtual stages only for 76B-530B."),
    )


_PTDP_TABLE1 = (
    # params, heads, hidden, layers, tp, pp, gpus, batch, micro, TFLOP/s, % peak, PFLOP/s, layers/vstage, ddp
    _ptdp_t1(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 137, 44, 4.4, None, "torch"),
    _ptdp_t1(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 138, 44, 8.8, None, "torch"),
    _ptdp_t1(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 142, 46, 18.2, None, "torch"),
    _ptdp_t1(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 135, 43, 34.6, None, "torch"),
    _ptdp_t1(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 138, 44, 70.8, None, "local"),
    _ptdp_t1(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 140, 45, 143.8, 5, "local"),
    _ptdp_t1(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 148, 47, 227.1, 5, "local"),
    _ptdp_t1(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 155, 50, 297.4, 3, "local"),
    _ptdp_t1(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 163, 52, 410.2, 1, "local"),
    _ptdp_t1(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 163, 52, 502.0, None, "local"),
)


# --- Megatron-LM PTD-P vs ZeRO-3, Table 2 / Figure 10 -----------------------------------------------

# 175B is "the standard GPT-3 model" (96 layers, 96 heads, hidden 12288: sec. 5.3.2); 530B is Table 1's.
_GPT_175B = dict(params_b=174.6, hidden=12288, layers=96, heads=96)
_GPT_530B = dict(params_b=529.6, hidden=20480, layers=105, heads=128)


def _ptdp_t2(scheme: str, shape: dict, gpus: int, batch: int, micro: int, tflops: float, days: int,
             note: str = "") -> PublishedRun:
    size = "175b" if shape is _GPT_175B else "530b"
    common = dict(source=_PTDP_T2, gpu="a100-80gb", gpus=gpus, ffn=4 * shape["hidden"],
                  kv_heads=shape["heads"], vocab=_GPT_VOCAB, seq_len=_GPT_SEQ, global_batch=batch,
                  micro_batch=micro, cp=1, precision="fp16", published_tflops_per_gpu=tflops,
                  published_tokens_per_s_per_gpu=None, published_mfu=None, flop_formula="ptdp_eq3", **shape)
    days_note = f"published training time for 300B tokens: {days} days (consistent with eq. 3 FLOPs)"
    if scheme == "zero3":
        return PublishedRun(
            name=f"ptdp-t2-zero3-{size}-{gpus}", tp=1, pp=1, dp=gpus, zero_stage_or_fsdp="zero3",
            recompute="full", deepspeed_differs="",
            notes=_differs(
                "ZeRO-3 from the DeepSpeed library integrated into Megatron (2021), no tensor or pipeline "
                f"parallelism, {batch // (gpus * micro)} micro-batch(es) per step", days_note,
                "recompute and fp16 not stated for these rows: assumed as in the rest of the paper "
                "(eq. 3 assumes recomputation; 'all results are run with mixed precision')", note),
            **common)
    model_parallel = 96 if shape is _GPT_175B else 280
    pp = model_parallel // 8
    return PublishedRun(
        name=f"ptdp-t2-ptdp-{size}-{gpus}", tp=8, pp=pp, dp=gpus // model_parallel, zero_stage_or_fsdp="none",
        recompute="full", deepspeed_differs=_differs(_SG, "interleaved 1F1B if used (Table 2 does not say)"),
        notes=_differs(
            f"Table 2 prints model-parallel size {model_parallel}, not the tp/pp split: tp=8, pp={pp} inferred "
            "(tp = GPUs per node throughout the paper; 530B is Table 1's (8, 35); 175B on 96 GPUs is "
            "(8, 12) in examples/sc21/run_figure_12.sh)", days_note,
            "whether the interleaved schedule was used for these rows is not stated", note),
        **common)


_PTDP_TABLE2 = (
    _ptdp_t2("zero3", _GPT_175B, 384, 1536, 4, 144, 90),
    _ptdp_t2("zero3", _GPT_175B, 768, 1536, 2, 88, 74),
    _ptdp_t2("zero3", _GPT_175B, 1536, 1536, 1, 44, 74),
    _ptdp_t2("zero3", _GPT_530B, 640, 2560, 4, 138, 169,
             "the 530B model did not fit on 560 GPUs at micro-batch 4 with ZeRO-3, so the paper used 640 GPUs "
             "and global batch 2560 (the row marked * in Table 2)"),
    _ptdp_t2("zero3", _GPT_530B, 1120, 2240, 2, 98, 137),
    _ptdp_t2("zero3", _GPT_530B, 2240, 2240, 1, 48, 140),
    _ptdp_t2("ptdp", _GPT_175B, 384, 1536, 1, 153, 84),
    _ptdp_t2("ptdp", _GPT_175B, 768, 1536, 1, 149, 43),
    _ptdp_t2("ptdp", _GPT_175B, 1536, 1536, 1, 141, 23),
    _ptdp_t2("ptdp", _GPT_530B, 560, 2240, 1, 171, 156),
    _ptdp_t2("ptdp", _GPT_530B, 1120, 2240, 1, 167, 80),
    _ptdp_t2("ptdp", _GPT_530B, 2240, 2240, 1, 159, 42),
)


# --- torchtitan ---------------------------------------------------------------------------------------

def _titan(name: str, source: str, model: str, gpus: int, *, dp: int, local_batch: int, tp: int = 1,
           pp: int = 1, cp: int = 1, seq_len: int = 8192, recompute: str, precision: str, tps: float,
           mfu: float | None = None, gpu: str = "h100-80gb", formula: str = "torchtitan_6N+attn",
           differs: str = "", notes: str) -> PublishedRun:
    return PublishedRun(
        name=name, source=source, gpu=gpu, gpus=gpus, vocab=_LLAMA_VOCAB, seq_len=seq_len,
        global_batch=local_batch * dp, micro_batch=local_batch if pp == 1 else None, tp=tp, pp=pp, cp=cp,
        dp=dp, zero_stage_or_fsdp="fsdp", recompute=recompute, precision=precision,
        published_tflops_per_gpu=None, published_tokens_per_s_per_gpu=tps, published_mfu=mfu,
        flop_formula=formula, deepspeed_differs=differs, sequence_parallel=tp > 1,
        notes=_differs(notes, f"local batch {local_batch}", _LLAMA_PARAMS_NOTE), **_LLAMA[model])


_SEQ_NOTE_2412 = "seq_len 8192: train_configs default at torchtitan 9dec370 (not printed in the file)"
_SEQ_NOTE_2506 = "seq_len 8192: train_configs default at torchtitan 820504e (not printed in the file)"
_GT = "Grand Teton H100 96GB HBM2e at 500 W"
_MFU_NOTE = ("the file says 8B 1D without Float8 on 8 or 128 GPUs reaches '33% to 39% MFU (with or without "
             "torch.compile, respectively)'; 6N+attn at seq 8192 / 989e12 gives 33.7% for 5,762 tps (no "
             "compile) and 39.0% for 6,667 (compile), so the file's 'respectively' is reversed; the "
             "assignment is ours")

_TORCHTITAN_2412 = (
    # Table 1: 1D FSDP, 8B, 8 GPUs, local batch 2, global 16, selective AC (per-op: config default)
    _titan("tt2412-t1-8b-8gpu-fsdp", _TT_2412 + " Table 1", "8b", 8, dp=8, local_batch=2,
           recompute="selective", precision="bf16", tps=5762, mfu=0.33, differs=_SAC,
           notes=_differs(_GT, _SEQ_NOTE_2412, "no compile; peak memory 82.4 GiB", _MFU_NOTE)),
    _titan("tt2412-t1-8b-8gpu-fsdp-compile", _TT_2412 + " Table 1", "8b", 8, dp=8, local_batch=2,
           recompute="selective", precision="bf16", tps=6667, mfu=0.39, differs=_SAC,
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile; peak memory 77.0 GiB", _MFU_NOTE)),
    _titan("tt2412-t1-8b-8gpu-fsdp-compile-fp8", _TT_2412 + " Table 1", "8b", 8, dp=8, local_batch=2,
           recompute="selective", precision="fp8", tps=8532, differs=_differs(_FP8, _SAC),
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8; peak memory 76.8 GiB; MFU not "
                          "reported for Float8 (mixed bf16/fp8 peaks)")),
    # Table 2: FSDP + CP + compile + Float8, 8B, 8 GPUs, local batch 1, full AC
    _titan("tt2412-t2-8b-fsdp8-cp1-32k", _TT_2412 + " Table 2", "8b", 8, dp=8, cp=1, local_batch=1,
           seq_len=32768, recompute="full", precision="fp8", tps=3890, differs=_FP8,
           notes=_differs(_GT, "torch.compile + Float8; peak memory 83.9 GiB")),
    _titan("tt2412-t2-8b-fsdp4-cp2-64k", _TT_2412 + " Table 2", "8b", 8, dp=4, cp=2, local_batch=1,
           seq_len=65536, recompute="full", precision="fp8", tps=2540, differs=_differs(_FP8, _RING),
           notes=_differs(_GT, "torch.compile + Float8; peak memory 84.2 GiB")),
    _titan("tt2412-t2-8b-fsdp2-cp4-128k", _TT_2412 + " Table 2", "8b", 8, dp=2, cp=4, local_batch=1,
           seq_len=131072, recompute="full", precision="fp8", tps=1071, differs=_differs(_FP8, _RING),
           notes=_differs(_GT, "torch.compile + Float8; peak memory 84.0 GiB")),
    _titan("tt2412-t2-8b-fsdp1-cp8-256k", _TT_2412 + " Table 2", "8b", 8, dp=1, cp=8, local_batch=1,
           seq_len=262144, recompute="full", precision="fp8", tps=548, differs=_differs(_FP8, _RING),
           notes=_differs(_GT, "torch.compile + Float8; peak memory 84.5 GiB; 'FSDP 1': torchtitan still "
                          "shards the weights over the cp ranks")),
    # Table 3: 1D FSDP, 8B, 128 GPUs, local batch 2, global 256, selective AC
    _titan("tt2412-t3-8b-128gpu-fsdp", _TT_2412 + " Table 3", "8b", 128, dp=128, local_batch=2,
           recompute="selective", precision="bf16", tps=5605, differs=_SAC,
           notes=_differs(_GT, _SEQ_NOTE_2412, "no compile; peak memory 67.0 GiB; covered by the file's "
                          "'33% to 39% MFU on 8 or 128 GPUs' (6N+attn gives 32.8%), not given per row")),
    _titan("tt2412-t3-8b-128gpu-fsdp-compile", _TT_2412 + " Table 3", "8b", 128, dp=128, local_batch=2,
           recompute="selective", precision="bf16", tps=6514, differs=_SAC,
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile; peak memory 62.0 GiB; 6N+attn gives 38.1%")),
    _titan("tt2412-t3-8b-128gpu-fsdp-compile-fp8", _TT_2412 + " Table 3", "8b", 128, dp=128, local_batch=2,
           recompute="selective", precision="fp8", tps=8380, differs=_differs(_FP8, _SAC),
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8; peak memory 61.8 GiB")),
    # Table 4: 2D FSDP + TP, 70B, 256 GPUs (FSDP 32, TP 8), local batch 16, global 512, full AC, compile + Float8
    _titan("tt2412-t4-70b-fsdp32-tp8", _TT_2412 + " Table 4", "70b", 256, dp=32, tp=8, local_batch=16,
           recompute="full", precision="fp8", tps=829, differs=_FP8,
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8; peak memory 71.9 GiB")),
    _titan("tt2412-t4-70b-fsdp32-tp8-asynctp", _TT_2412 + " Table 4", "70b", 256, dp=32, tp=8, local_batch=16,
           recompute="full", precision="fp8", tps=876, differs=_differs(_FP8, _ATP),
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8 + async TP; peak memory 67.6 GiB")),
    # Table 5: 3D FSDP + TP + PP, 405B, 512 GPUs (FSDP 8, TP 8, PP 8), local batch 32, global 256, full AC
    _titan("tt2412-t5-405b-fsdp8-tp8-pp8-1f1b", _TT_2412 + " Table 5", "405b", 512, dp=8, tp=8, pp=8,
           local_batch=32, recompute="full", precision="fp8", tps=100, differs=_differs(_FP8, _ATP, _FSDP_PP),
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8 + async TP, 1F1B; peak memory 82.5 GiB "
                          "(max over PP ranks); micro-batch not printed (torchtitan's default splits the local "
                          "batch into as many micro-batches as pipeline stages)")),
    _titan("tt2412-t5-405b-fsdp8-tp8-pp8-interleaved", _TT_2412 + " Table 5", "405b", 512, dp=8, tp=8, pp=8,
           local_batch=32, recompute="full", precision="fp8", tps=128,
           differs=_differs("interleaved 1F1B", _FP8, _ATP, _FSDP_PP),
           notes=_differs(_GT, _SEQ_NOTE_2412, "torch.compile + Float8 + async TP, interleaved 1F1B (stages per "
                          "rank not printed); peak memory 72.7 GiB; micro-batch not printed")),
    # Table 6: 4D FSDP + TP + PP + CP, 405B, 512 GPUs (TP 8, PP 8), local batch 8, full AC, 1F1B
    _titan("tt2412-t6-405b-fsdp8-cp1-32k", _TT_2412 + " Table 6", "405b", 512, dp=8, tp=8, pp=8, cp=1,
           local_batch=8, seq_len=32768, recompute="full", precision="fp8", tps=76,
           differs=_differs(_FP8, _ATP, _FSDP_PP),
           notes=_differs(_GT, "torch.compile + Float8 + async TP, 1F1B; peak memory 75.3 GiB; global batch = "
                          "local x FSDP (ours); micro-batch not printed")),
    _titan("tt2412-t6-405b-fsdp4-cp2-64k", _TT_2412 + " Table 6", "405b", 512, dp=4, tp=8, pp=8, cp=2,
           local_batch=8, seq_len=65536, recompute="full", precision="fp8", tps=47,
           differs=_differs(_FP8, _ATP, _FSDP_PP, _RING, _CP_PP),
           notes=_differs(_GT, "torch.compile + Float8 + async TP, 1F1B; peak memory 75.9 GiB; global batch = "
                          "local x FSDP (ours); micro-batch not printed")),
    _titan("tt2412-t6-405b-fsdp2-cp4-128k", _TT_2412 + " Table 6", "405b", 512, dp=2, tp=8, pp=8, cp=4,
           local_batch=8, seq_len=131072, recompute="full", precision="fp8", tps=31,
           differs=_differs(_FP8, _ATP, _FSDP_PP, _RING, _CP_PP),
           notes=_differs(_GT, "torch.compile + Float8 + async TP, 1F1B; peak memory 77.1 GiB; global batch = "
                          "local x FSDP (ours); micro-batch not printed")),
    _titan("tt2412-t6-405b-fsdp1-cp8-256k", _TT_2412 + " Table 6", "405b", 512, dp=1, tp=8, pp=8, cp=8,
           local_batch=8, seq_len=262144, recompute="full", precision="fp8", tps=16,
           differs=_differs(_FP8, _ATP, _FSDP_PP, _RING, _CP_PP),
           notes=_differs(_GT, "torch.compile + Float8 + async TP, 1F1B; peak memory 84.9 GiB; global batch = "
                          "local x FSDP (ours); micro-batch not printed")),
)


def _async_tp_pair(model: str, gpus: int, dp: int, local_batch: int, recompute: str, quant: str,
                   vanilla: float, async_tp: float, speedup: float) -> tuple[PublishedRun, PublishedRun]:
    precision = "bf16" if quant == "bf16" else "fp8"
    fp8 = _FP8 if precision == "fp8" else ""
    sac = _SAC if recompute == "selective" else ""
    ac = "per-op selective AC" if recompute == "selective" else "full AC"
    base = (f"{_GT}; {_SEQ_NOTE_2506}; torch.compile, {ac}; quantization '{quant}'; published async TP "
            f"speedup {speedup}; the column says tokens/sec, per GPU by its magnitude (cf. the 2024-12 file)")
    rows = []
    for tag, tps, atp in (("vanilla-tp", vanilla, ""), ("async-tp", async_tp, _ATP)):
        rows.append(_titan(f"tt2506-{model}-fsdp{dp}-tp8-{quant}-{tag}", _TT_ATP, model, gpus, dp=dp, tp=8,
                           local_batch=local_batch, recompute=recompute, precision=precision, tps=tps,
                           differs=_differs(fp8, atp, sac), notes=base))
    return rows[0], rows[1]


_TORCHTITAN_ASYNC_TP = (
    # Llama3 70B on 256 H100s, FSDP 32, TP 8, torch.compile, full AC, local batch 16
    *_async_tp_pair("70b", 256, 32, 16, "full", "bf16", 597.3, 652.4, 1.09),
    *_async_tp_pair("70b", 256, 32, 16, "full", "fp8-tensorwise", 809.8, 942.4, 1.16),
    *_async_tp_pair("70b", 256, 32, 16, "full", "fp8-rowwise", 599.6, 624.8, 1.04),
    # Llama3 8B on 64 H100s, FSDP 8, TP 8, torch.compile, per-op SAC, local batch 12
    *_async_tp_pair("8b", 64, 8, 12, "selective", "bf16", 4378, 4809.4, 1.10),
    *_async_tp_pair("8b", 64, 8, 12, "selective", "fp8-tensorwise", 5078.1, 5570.1, 1.10),
    *_async_tp_pair("8b", 64, 8, 12, "selective", "fp8-rowwise", 3708.5, 3914.9, 1.06),
)

_H200_NOTE = ("Trainy on WhiteFiber, 8 x H200 per host, 400 Gb/s per GPU; torch.compile, Float8 with FSDP "
              "float8 all-gather and force_recompute_fp8_weight_in_bwd; AC per-op selective and seq_len 8192: "
              "llama3_8b.toml defaults at torchtitan e7c0cae (not printed); TPS sampled at iteration 100")

_TORCHTITAN_H200 = (
    _titan("tt2506-h200-8b-32gpu-fsdp-fp8", _TT_H200, "8b", 32, dp=32, local_batch=2, gpu="h200-141gb",
           recompute="selective", precision="fp8", tps=10938, differs=_differs(_FP8, _SAC),
           notes=_differs(_H200_NOTE, "4 nodes; peak memory 47.96 GiB")),
    _titan("tt2506-h200-8b-64gpu-fsdp-fp8", _TT_H200, "8b", 64, dp=64, local_batch=2, gpu="h200-141gb",
           recompute="selective", precision="fp8", tps=10753, differs=_differs(_FP8, _SAC),
           notes=_differs(_H200_NOTE, "8 nodes; peak memory 46.97 GiB")),
)

_NOTE_2408 = ("Llama 3.1 405B on 128 H100 ('HBM2e based lower TDP SXM H100 (95GB)'), 2D FSDP 16 x TP 8, "
              "local batch 2, global 32, full AC; seq_len 8192 from llama3_405b.toml at that commit (not "
              "printed); MFU against 989e12 although the cards are slower")

_TORCHTITAN_2408 = (
    _titan("tt2408-405b-fsdp16-tp8", _TT_2408, "405b", 128, dp=16, tp=8, local_batch=2, recompute="full",
           precision="bf16", tps=109, mfu=0.290,
           notes=_differs(_NOTE_2408, "'Optimizations: None' (no Float8, no async TP); whether torch.compile "
                          "was on is not printed (the toml at that commit sets compile = true)")),
    _titan("tt2408-405b-fsdp16-tp8-fp8", _TT_2408, "405b", 128, dp=16, tp=8, local_batch=2, recompute="full",
           precision="fp8", tps=177, mfu=0.2346, differs=_FP8,
           notes=_differs(_NOTE_2408, "Float8; the file notes attention is not in FP8, so MFU reads low; "
                          "6N+attn against 2 x 989e12 gives 23.5% (our back-calculation: FP8 peak)")),
    _titan("tt2408-405b-fsdp16-tp8-fp8-asynctp", _TT_2408, "405b", 128, dp=16, tp=8, local_batch=2,
           recompute="full", precision="fp8", tps=185, mfu=0.2452, differs=_differs(_FP8, _ATP),
           notes=_differs(_NOTE_2408, "Float8 + async TP")),
)

_NOTE_2404 = ("Llama 3 (same shapes as 3.1) on 64 A100 80GB, 1D FSDP, local batch 1, global 64; seq_len 8192, "
              "compile off, bf16 params / fp32 reduce: configs at that commit (not printed); WPS = tokens/s/GPU")

_TORCHTITAN_2404 = (
    _titan("tt2404-a100-8b-fsdp64-sac-layer", _TT_2404, "8b", 64, dp=64, local_batch=1, gpu="a100-80gb",
           recompute="selective", precision="bf16", tps=2904, mfu=0.568, formula="torchtitan_6Nall+attn",
           differs=_SAC, notes=_differs(_NOTE_2404, "'selective layer' AC: every 2nd layer checkpointed "
                                        "(selective_ac_option default '2')")),
    _titan("tt2404-a100-8b-fsdp64-sac-op", _TT_2404, "8b", 64, dp=64, local_batch=1, gpu="a100-80gb",
           recompute="selective", precision="bf16", tps=2973, mfu=0.582, formula="torchtitan_6Nall+attn",
           differs=_SAC, notes=_differs(_NOTE_2404, "'selective op' AC")),
    _titan("tt2404-a100-70b-fsdp64-full", _TT_2404, "70b", 64, dp=64, local_batch=1, gpu="a100-80gb",
           recompute="full", precision="bf16", tps=331, mfu=0.517, formula="torchtitan_6Nall+attn",
           notes=_NOTE_2404),
)


RUNS: tuple[PublishedRun, ...] = (
    *_PTDP_TABLE1,
    *_PTDP_TABLE2,
    *_TORCHTITAN_2412,
    *_TORCHTITAN_ASYNC_TP,
    *_TORCHTITAN_H200,
    *_TORCHTITAN_2408,
    *_TORCHTITAN_2404,
)
