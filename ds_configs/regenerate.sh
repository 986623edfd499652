#!/usr/bin/env bash
# The DeepSpeed JSON presets in this folder, each written by `dsf config`.
# tests/unit/test_dsconfig.py runs every `dsf config` line below and fails if a file drifts.
# Batch: micro 4 x accum 1 per rank; train_batch_size is derived by DeepSpeed at launch.
set -euo pipefail
cd "$(dirname "$0")"
dsf config --zero-stage 0 --precision fp32 --micro-batch 4 --grad-accum 1 -o zero0_fp32.json --force
dsf config --zero-stage 0 --precision bf16 --micro-batch 4 --grad-accum 1 -o zero0_bf16.json --force
dsf config --zero-stage 1 --precision fp32 --micro-batch 4 --grad-accum 1 -o zero1_fp32.json --force
dsf config --zero-stage 1 --precision bf16 --micro-batch 4 --grad-accum 1 -o zero1_bf16.json --force
dsf config --zero-stage 2 --precision fp32 --micro-batch 4 --grad-accum 1 -o zero2_fp32.json --force
dsf config --zero-stage 2 --precision bf16 --micro-batch 4 --grad-accum 1 -o zero2_bf16.json --force
dsf config --zero-stage 3 --precision fp32 --micro-batch 4 --grad-accum 1 -o zero3_fp32.json --force
dsf config --zero-stage 3 --precision bf16 --micro-batch 4 --grad-accum 1 -o zero3_bf16.json --force
dsf config --zero-stage 2 --offload-optimizer cpu --precision fp32 --micro-batch 4 --grad-accum 1 -o zero2_offload_fp32.json --force
dsf config --zero-stage 2 --offload-optimizer cpu --precision bf16 --micro-batch 4 --grad-accum 1 -o zero2_offload_bf16.json --force
dsf config --zero-stage 3 --offload-optimizer cpu --offload-param cpu --precision fp32 --micro-batch 4 --grad-accum 1 -o zero3_offload_fp32.json --force
dsf config --zero-stage 3 --offload-optimizer cpu --offload-param cpu --precision bf16 --micro-batch 4 --grad-accum 1 -o zero3_offload_bf16.json --force
# Pipeline (2 stages, ZeRO-1 over the data-parallel ranks; any world divisible by 2).
dsf config --pp 2 --zero-stage 1 --precision bf16 --micro-batch 4 --grad-accum 8 -o pp2_zero1_bf16.json --force
# 3D: tp 2 x pp 2 x dp 2 on 8 GPUs, global batch 64 (tp is in the model and its mpu, not the JSON).
dsf config --tp 2 --pp 2 --world-size 8 --zero-stage 1 --precision bf16 --micro-batch 2 --global-batch 64 -o tp2_pp2_dp2_zero1_bf16.json --force
